"""usage_records.reasoning_tokens and usage_daily.reasoning_tokens: of the completion tokens, those a
reasoning model spent thinking (billed as completion tokens; shown in reports and their CSV).

Revision ID: 0007_usage_reasoning_tokens
Revises: 0006_usage_end_user
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_usage_reasoning_tokens"
down_revision = "0006_usage_end_user"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A constant default is a catalogue change since PostgreSQL 11, not a rewrite of the partitions.
    op.add_column(
        "usage_records", sa.Column("reasoning_tokens", sa.Integer(), nullable=False, server_default="0")
    )
    op.add_column(
        "usage_daily", sa.Column("reasoning_tokens", sa.BigInteger(), nullable=False, server_default="0")
    )


def downgrade() -> None:
    op.drop_column("usage_daily", "reasoning_tokens")
    op.drop_column("usage_records", "reasoning_tokens")
