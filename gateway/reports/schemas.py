"""Prices and report bodies. Money leaves the API as decimal strings."""

from __future__ import annotations

from datetime import date, datetime
from decimal import Decimal

from pydantic import BaseModel, ConfigDict, Field, field_serializer

from gateway.bounds import IsoDate, Name
from gateway.bounds import Numeric20_10 as PriceValue
from gateway.reports.pricing import money_str

GROUP_FIELDS: dict[str, str] = {
    "day": "day",
    "model": "model",
    "key": "key_id",
    "tenant": "tenant_id",
    "user": "end_user",
}
"""group_by value -> the row field it adds."""

METRICS = (
    "requests",
    "errors",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "total_tokens",
    "cost",
)


class PriceCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Name
    effective_from: IsoDate | None = Field(None, description="UTC day the price starts; default today")
    prompt_per_mtok: PriceValue
    cached_prompt_per_mtok: PriceValue | None = Field(None, description="default: the prompt price")
    completion_per_mtok: PriceValue


class PriceOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    model: str
    effective_from: date
    prompt_per_mtok: Decimal
    cached_prompt_per_mtok: Decimal
    completion_per_mtok: Decimal
    created_at: datetime

    @field_serializer("prompt_per_mtok", "cached_prompt_per_mtok", "completion_per_mtok")
    def _money(self, value: Decimal) -> str:
        return money_str(value)


class PriceList(BaseModel):
    data: list[PriceOut]


class BillLine(BaseModel):
    """One model at one price over the month."""

    model: str
    price_effective_from: date | None
    prompt_per_mtok: str | None
    cached_prompt_per_mtok: str | None
    completion_per_mtok: str | None
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost: str


class Bill(BaseModel):
    tenant_id: str
    month: str
    lines: list[BillLine]
    total_tokens: int
    total_cost: str
