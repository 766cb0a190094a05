"""Core schema: tenants, API keys and the audit log.

Revision ID: 0001_core
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001_core"
down_revision = None
branch_labels = None
depends_on = None

TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", postgresql.UUID(as_uuid=True), primary_key=True),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False, server_default="active"),
        sa.Column("created_at", TIMESTAMP, nullable=False, server_default=sa.func.now()),
        sa.Column("deleted_at", TIMESTAMP),
        sa.CheckConstraint("status IN ('active', 'suspended')", name="status"),
    )
    op.create_index(
        "uq_tenants_name_live",
        "tenants",
        ["name"],
        unique=True,
        postgresql_where=sa.text("deleted_at IS NULL"),
    )

    op.create_table(
        "api_keys",
        sa.Column("id", postgresql.UUID(as_uuid=True), primary_key=True),
        sa.Column("tenant_id", postgresql.UUID(as_uuid=True), sa.ForeignKey("tenants.id")),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("hint", sa.Text(), nullable=False),
        sa.Column("secret_hash", sa.Text(), nullable=False),
        sa.Column("models", postgresql.ARRAY(sa.Text()), nullable=False, server_default=sa.text("'{}'")),
        sa.Column("rpm_limit", sa.Integer()),
        sa.Column("tpm_limit", sa.Integer()),
        sa.Column("max_concurrency", sa.Integer()),
        sa.Column("monthly_token_budget", sa.BigInteger()),
        sa.Column("expires_at", TIMESTAMP),
        sa.Column("revoked_at", TIMESTAMP),
        sa.Column("created_at", TIMESTAMP, nullable=False, server_default=sa.func.now()),
        sa.Column("last_used_at", TIMESTAMP),
        sa.Column("rotated_from", postgresql.UUID(as_uuid=True), sa.ForeignKey("api_keys.id")),
        sa.CheckConstraint("kind IN ('inference', 'admin')", name="kind"),
        sa.CheckConstraint("kind = 'admin' OR tenant_id IS NOT NULL", name="inference_has_tenant"),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    op.create_index("uq_api_keys_secret_hash", "api_keys", ["secret_hash"], unique=True)

    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column("at", TIMESTAMP, nullable=False, server_default=sa.func.now()),
        sa.Column("actor_key_id", postgresql.UUID(as_uuid=True), sa.ForeignKey("api_keys.id")),
        sa.Column("tenant_id", postgresql.UUID(as_uuid=True), sa.ForeignKey("tenants.id")),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("object_type", sa.Text(), nullable=False),
        sa.Column("object_id", sa.Text(), nullable=False),
        sa.Column("before", postgresql.JSONB()),
        sa.Column("after", postgresql.JSONB()),
        sa.Column("request_id", sa.Text()),
    )
    op.create_index("ix_audit_log_at", "audit_log", ["at"])
    op.create_index("ix_audit_log_object", "audit_log", ["object_type", "object_id"])
    op.create_index("ix_audit_log_actor_key_id", "audit_log", ["actor_key_id"])
    op.create_index("ix_audit_log_tenant_id_at", "audit_log", ["tenant_id", "at"])


def downgrade() -> None:
    op.drop_table("audit_log")
    op.drop_table("api_keys")
    op.drop_table("tenants")
