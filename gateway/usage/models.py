"""Raw usage rows (one per request, partitioned by month) and their daily rollups."""

from __future__ import annotations

import uuid
from datetime import date, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    Date,
    DateTime,
    Double,
    Index,
    Integer,
    PrimaryKeyConstraint,
    SmallInteger,
    Text,
    false,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import UUID
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db import Base


class UsageRow(Base):
    """One request. Range-partitioned by ``started_at`` (one partition per month, see partitions.py).

    A partitioned table's unique keys must contain the partition column, so the identity is
    (request_id, started_at): both are fixed when the request starts, so a replay of the same
    record always hits the same row.
    """

    __tablename__ = "usage_records"
    __table_args__ = (
        PrimaryKeyConstraint("request_id", "started_at"),
        Index("ix_usage_records_key_id_started_at", "key_id", "started_at"),
        Index("ix_usage_records_tenant_id_started_at", "tenant_id", "started_at"),
        {"postgresql_partition_by": "RANGE (started_at)"},
    )

    request_id: Mapped[str] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    tenant_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), nullable=False)
    key_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), nullable=False)
    model: Mapped[str] = mapped_column(Text, nullable=False)
    endpoint: Mapped[str] = mapped_column(Text, nullable=False)
    prompt_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    cached_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    completion_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    reasoning_tokens: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    """Of ``completion_tokens``, those a reasoning model spent thinking (billed as completion tokens)."""
    status: Mapped[int] = mapped_column(SmallInteger, nullable=False)
    finish_reason: Mapped[str | None] = mapped_column(Text)
    ttft_ms: Mapped[float | None] = mapped_column(Double)
    duration_ms: Mapped[float] = mapped_column(Double, nullable=False)
    usage_estimated: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=false())
    """The engine reported no usage (an ``openai`` engine that does not, a broken stream): the
    gateway counted the tokens itself (gateway/proxy/token_count.py)."""
    end_user: Mapped[str | None] = mapped_column(Text)
    """The request's OpenAI ``user`` field (at most 256 characters), for reports by end user."""
    recorded_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now()
    )


class UsageDaily(Base):
    """Sums of raw rows per UTC day x tenant x key x model, upserted in the raw insert's transaction."""

    __tablename__ = "usage_daily"
    __table_args__ = (
        PrimaryKeyConstraint("day", "tenant_id", "key_id", "model"),
        Index("ix_usage_daily_tenant_id_day", "tenant_id", "day"),
        Index("ix_usage_daily_key_id_day", "key_id", "day"),
    )

    day: Mapped[date] = mapped_column(Date)
    tenant_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True))
    key_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True))
    model: Mapped[str] = mapped_column(Text)
    requests: Mapped[int] = mapped_column(BigInteger, nullable=False)
    errors: Mapped[int] = mapped_column(BigInteger, nullable=False)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False)
    reasoning_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
