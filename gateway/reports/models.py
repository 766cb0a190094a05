"""Prices per model, with the day each price takes effect. Money is Numeric, never float."""

from __future__ import annotations

from datetime import date, datetime
from decimal import Decimal

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Date,
    DateTime,
    Identity,
    Numeric,
    Text,
    UniqueConstraint,
    func,
)
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db import Base

PRICE = Numeric(20, 10)


class ModelPrice(Base):
    """Prices per 1M tokens. The price of a day is the row with the latest ``effective_from`` <= day.

    ``prompt`` applies to uncached prompt tokens, ``cached_prompt`` to cached ones.
    """

    __tablename__ = "model_prices"
    __table_args__ = (
        UniqueConstraint("model", "effective_from"),
        CheckConstraint(
            "prompt_per_mtok >= 0 AND cached_prompt_per_mtok >= 0 AND completion_per_mtok >= 0",
            name="non_negative",
        ),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    model: Mapped[str] = mapped_column(Text, nullable=False)
    effective_from: Mapped[date] = mapped_column(Date, nullable=False)
    prompt_per_mtok: Mapped[Decimal] = mapped_column(PRICE, nullable=False)
    cached_prompt_per_mtok: Mapped[Decimal] = mapped_column(PRICE, nullable=False)
    completion_per_mtok: Mapped[Decimal] = mapped_column(PRICE, nullable=False)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now()
    )
