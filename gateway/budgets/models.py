"""Budgets: a cap on a key's or a tenant's tokens or spend per period (``budgets`` table).

The ``monthly_token_budget`` / ``monthly_spend_budget`` fields of keys and tenant limits stay what
they were: each is a ``month`` budget without a row here (``gateway.limits.policies`` adds them).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal

from sqlalchemy import BigInteger, CheckConstraint, DateTime, ForeignKey, Identity, Index, Numeric, Text, func
from sqlalchemy.dialects.postgresql import UUID
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db import Base

METRICS = ("tokens", "spend")


class BudgetRow(Base):
    """One budget. ``key_id`` null: the whole tenant's; else one key's."""

    __tablename__ = "budgets"
    __table_args__ = (
        CheckConstraint("metric IN ('tokens', 'spend')", name="metric"),
        CheckConstraint("period IN ('day', 'week', 'month', 'total')", name="period"),
        CheckConstraint("amount >= 0", name="amount"),
        CheckConstraint("alert_ratio > 0 AND alert_ratio <= 1", name="alert_ratio"),
        Index(
            "uq_budgets_owner",
            "tenant_id",
            "key_id",
            "metric",
            "period",
            unique=True,
            postgresql_nulls_not_distinct=True,
        ),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    tenant_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False
    )
    key_id: Mapped[uuid.UUID | None] = mapped_column(
        UUID(as_uuid=True), ForeignKey("api_keys.id", ondelete="CASCADE"), index=True
    )
    metric: Mapped[str] = mapped_column(Text, nullable=False)
    period: Mapped[str] = mapped_column(Text, nullable=False)
    amount: Mapped[Decimal] = mapped_column(Numeric(20, 6), nullable=False)
    """Tokens (a whole number) or money in the prices' currency."""
    alert_ratio: Mapped[Decimal | None] = mapped_column(Numeric(4, 3))
    """Soft threshold: at this share of ``amount`` one alert is sent per period (null: none)."""
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now()
    )
