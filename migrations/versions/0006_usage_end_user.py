"""usage_records.end_user: the request's OpenAI ``user`` field, for reports by end user.

Revision ID: 0006_usage_end_user
Revises: 0005_budgets
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_usage_end_user"
down_revision = "0005_budgets"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # On the partitioned parent, nullable, no default: a catalogue change, not a rewrite.
    op.add_column("usage_records", sa.Column("end_user", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("usage_records", "end_user")
