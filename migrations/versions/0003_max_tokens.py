"""Per-tenant and per-key max_tokens: what a request without max_tokens gets, and the most any gets
(over TERN_LIMITS_DEFAULT_MAX_TOKENS, which applies where neither is set).

Revision ID: 0003_max_tokens
Revises: 0002_usage
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_max_tokens"
down_revision = "0002_usage"
branch_labels = None
depends_on = None

TABLES = ("tenant_limits", "key_limits")


def upgrade() -> None:
    for table in TABLES:
        op.add_column(table, sa.Column("max_tokens", sa.Integer(), nullable=True))
        op.create_check_constraint("max_tokens", table, "max_tokens >= 1")


def downgrade() -> None:
    for table in TABLES:
        op.drop_constraint("max_tokens", table, type_="check")  # ck_<table>_max_tokens, by convention
        op.drop_column(table, "max_tokens")
