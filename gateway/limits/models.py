"""Limits that are not columns of ``api_keys``: whole-tenant limits and per-key extras."""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import BigInteger, CheckConstraint, DateTime, ForeignKey, Integer, Numeric, Text, func, text
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db import Base

MONEY = Numeric(20, 6)


class TenantLimits(Base):
    """Limits on a tenant as a whole (all its keys together). Null means unlimited."""

    __tablename__ = "tenant_limits"

    tenant_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    rpm_limit: Mapped[int | None] = mapped_column(Integer)
    tpm_limit: Mapped[int | None] = mapped_column(Integer)
    max_concurrency: Mapped[int | None] = mapped_column(Integer)
    monthly_token_budget: Mapped[int | None] = mapped_column(BigInteger)
    monthly_spend_budget: Mapped[Decimal | None] = mapped_column(MONEY)
    max_tokens: Mapped[int | None] = mapped_column(
        Integer, CheckConstraint("max_tokens >= 1", name="max_tokens")
    )
    model_limits: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, server_default=text("'{}'"))
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now()
    )


class KeyLimits(Base):
    """A key's spend budget, Redis-outage policy, max_tokens and per-model limits (rpm/tpm/etc. live on
    api_keys)."""

    __tablename__ = "key_limits"
    __table_args__ = (CheckConstraint("failure_policy IN ('closed', 'open')", name="failure_policy"),)

    key_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("api_keys.id", ondelete="CASCADE"), primary_key=True
    )
    monthly_spend_budget: Mapped[Decimal | None] = mapped_column(MONEY)
    failure_policy: Mapped[str | None] = mapped_column(Text)
    max_tokens: Mapped[int | None] = mapped_column(
        Integer, CheckConstraint("max_tokens >= 1", name="max_tokens")
    )
    model_limits: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, server_default=text("'{}'"))
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now()
    )
