"""budgets: token and spend budgets per key or tenant with a period (day, week, month, total) and an
optional alert threshold.

The monthly budget columns of api_keys, key_limits and tenant_limits stay and keep working: each is a
month budget without a row here.

Revision ID: 0005_budgets
Revises: 0004_usage_estimated
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision = "0005_budgets"
down_revision = "0004_usage_estimated"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "budgets",
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column(
            "tenant_id", UUID(as_uuid=True), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("key_id", UUID(as_uuid=True), sa.ForeignKey("api_keys.id", ondelete="CASCADE")),
        sa.Column("metric", sa.Text(), nullable=False),
        sa.Column("period", sa.Text(), nullable=False),
        sa.Column("amount", sa.Numeric(20, 6), nullable=False),
        sa.Column("alert_ratio", sa.Numeric(4, 3)),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.CheckConstraint("metric IN ('tokens', 'spend')", name="metric"),
        sa.CheckConstraint("period IN ('day', 'week', 'month', 'total')", name="period"),
        sa.CheckConstraint("amount >= 0", name="amount"),
        sa.CheckConstraint("alert_ratio > 0 AND alert_ratio <= 1", name="alert_ratio"),
    )
    op.create_index("ix_budgets_key_id", "budgets", ["key_id"])
    op.create_index(
        "uq_budgets_owner",
        "budgets",
        ["tenant_id", "key_id", "metric", "period"],
        unique=True,
        postgresql_nulls_not_distinct=True,
    )


def downgrade() -> None:
    op.drop_table("budgets")
