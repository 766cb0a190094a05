"""Budget bodies of ``/admin/budgets``."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.bounds import Numeric20_6 as Amount
from gateway.budgets.periods import Period

AlertRatio = Annotated[float, Field(gt=0, le=1, description="0.8: alert at 80% (3 decimals kept)")]


class BudgetCreate(BaseModel):
    """A tenant's budget (no ``key_id``) or one key's. ``amount``: tokens, or money in the prices'
    currency. ``alert_ratio``: the share of ``amount`` at which one alert is sent per period."""

    model_config = ConfigDict(extra="forbid")

    tenant_id: uuid.UUID
    key_id: uuid.UUID | None = None
    metric: Literal["tokens", "spend"]
    period: Period
    amount: Amount
    alert_ratio: AlertRatio | None = None


class BudgetStatus(BaseModel):
    """A budget and where it stands in its current period. ``id`` is null for the ``monthly_*_budget``
    fields of a key or tenant (set where they always were)."""

    id: int | None
    tenant_id: uuid.UUID
    key_id: uuid.UUID | None
    metric: Literal["tokens", "spend"]
    period: Period
    limit: str
    """Tokens or money, as a decimal string."""
    used: str
    """Settled usage in this period (tokens, or money as a decimal string)."""
    reserved: str
    """Worst cases of requests in flight, held until they settle."""
    used_ratio: float
    alert_ratio: float | None
    period_start: datetime
    resets_at: datetime | None
    """None for a ``total`` budget."""


class BudgetList(BaseModel):
    data: list[BudgetStatus]
