"""Usage metering, prices and limits: usage_records (monthly partitions), usage_daily, model_prices,
tenant_limits, key_limits.

Monthly partitions of usage_records are created by the gateway at start-up and ahead of time
(gateway/usage/partitions.py), not here, so retention can drop them as months go by.

Revision ID: 0002_usage
Revises: 0001_core
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002_usage"
down_revision = "0001_core"
branch_labels = None
depends_on = None

TIMESTAMP = sa.DateTime(timezone=True)
UUID = postgresql.UUID(as_uuid=True)
PRICE = sa.Numeric(20, 10)
MONEY = sa.Numeric(20, 6)


def upgrade() -> None:
    op.create_table(
        "usage_records",
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("started_at", TIMESTAMP, nullable=False),
        sa.Column("finished_at", TIMESTAMP, nullable=False),
        sa.Column("tenant_id", UUID, nullable=False),
        sa.Column("key_id", UUID, nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("endpoint", sa.Text(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("status", sa.SmallInteger(), nullable=False),
        sa.Column("finish_reason", sa.Text()),
        sa.Column("ttft_ms", sa.Double()),
        sa.Column("duration_ms", sa.Double(), nullable=False),
        sa.Column("recorded_at", TIMESTAMP, nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("request_id", "started_at", name="pk_usage_records"),
        postgresql_partition_by="RANGE (started_at)",
    )
    op.create_index("ix_usage_records_key_id_started_at", "usage_records", ["key_id", "started_at"])
    op.create_index("ix_usage_records_tenant_id_started_at", "usage_records", ["tenant_id", "started_at"])

    op.create_table(
        "usage_daily",
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("tenant_id", UUID, nullable=False),
        sa.Column("key_id", UUID, nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("errors", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("day", "tenant_id", "key_id", "model", name="pk_usage_daily"),
    )
    op.create_index("ix_usage_daily_tenant_id_day", "usage_daily", ["tenant_id", "day"])
    op.create_index("ix_usage_daily_key_id_day", "usage_daily", ["key_id", "day"])

    op.create_table(
        "model_prices",
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("effective_from", sa.Date(), nullable=False),
        sa.Column("prompt_per_mtok", PRICE, nullable=False),
        sa.Column("cached_prompt_per_mtok", PRICE, nullable=False),
        sa.Column("completion_per_mtok", PRICE, nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False, server_default=sa.func.now()),
        sa.UniqueConstraint("model", "effective_from", name="uq_model_prices_model_effective_from"),
        sa.CheckConstraint(
            "prompt_per_mtok >= 0 AND cached_prompt_per_mtok >= 0 AND completion_per_mtok >= 0",
            name="ck_model_prices_non_negative",
        ),
    )

    op.create_table(
        "tenant_limits",
        sa.Column(
            "tenant_id",
            UUID,
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            primary_key=True,
            nullable=False,
        ),
        sa.Column("rpm_limit", sa.Integer()),
        sa.Column("tpm_limit", sa.Integer()),
        sa.Column("max_concurrency", sa.Integer()),
        sa.Column("monthly_token_budget", sa.BigInteger()),
        sa.Column("monthly_spend_budget", MONEY),
        sa.Column("model_limits", postgresql.JSONB(), nullable=False, server_default=sa.text("'{}'")),
        sa.Column("updated_at", TIMESTAMP, nullable=False, server_default=sa.func.now()),
    )

    op.create_table(
        "key_limits",
        sa.Column(
            "key_id", UUID, sa.ForeignKey("api_keys.id", ondelete="CASCADE"), primary_key=True, nullable=False
        ),
        sa.Column("monthly_spend_budget", MONEY),
        sa.Column("failure_policy", sa.Text()),
        sa.Column("model_limits", postgresql.JSONB(), nullable=False, server_default=sa.text("'{}'")),
        sa.Column("updated_at", TIMESTAMP, nullable=False, server_default=sa.func.now()),
        sa.CheckConstraint("failure_policy IN ('closed', 'open')", name="ck_key_limits_failure_policy"),
    )


def downgrade() -> None:
    op.drop_table("key_limits")
    op.drop_table("tenant_limits")
    op.drop_table("model_prices")
    op.drop_table("usage_daily")
    op.drop_table("usage_records")  # its monthly partitions go with it
