"""usage_records.usage_estimated: the engine reported no usage and the gateway counted the tokens
itself (an OpenAI-compatible engine that does not report usage, a stream that broke).

Revision ID: 0004_usage_estimated
Revises: 0003_max_tokens
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_usage_estimated"
down_revision = "0003_max_tokens"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # On the partitioned parent: PostgreSQL adds it to every monthly partition, and with a constant
    # default it is a catalogue change, not a rewrite of the rows already stored.
    op.add_column(
        "usage_records",
        sa.Column("usage_estimated", sa.Boolean(), nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    op.drop_column("usage_records", "usage_estimated")
