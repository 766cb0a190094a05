"""Cost arithmetic, in exact decimals, shared by the reports (SQL) and the spend budgets (Python).

cost = ((prompt - cached) * prompt_price + cached * cached_price + completion * completion_price) / 1e6

``prompt_tokens`` includes cached tokens (OpenAI's convention), so cached ones are priced apart.
The price of a UTC day is the model's row with the latest ``effective_from`` on or before it.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from datetime import date
from decimal import Decimal, localcontext

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.reports.models import ModelPrice

MILLION_EXP = -6

PRICE_LATERAL = """
LEFT JOIN LATERAL (
    SELECT p.id, p.effective_from, p.prompt_per_mtok, p.cached_prompt_per_mtok, p.completion_per_mtok
    FROM model_prices p
    WHERE p.model = d.model AND p.effective_from <= d.day
    ORDER BY p.effective_from DESC
    LIMIT 1
) p ON true
"""
"""Joins each ``usage_daily d`` row to the price in effect on its day (NULLs when unpriced)."""

COST_MICRO_SQL = (
    "((d.prompt_tokens - d.cached_tokens) * coalesce(p.prompt_per_mtok, 0)"
    " + d.cached_tokens * coalesce(p.cached_prompt_per_mtok, 0)"
    " + d.completion_tokens * coalesce(p.completion_per_mtok, 0))"
)
"""Cost times one million: multiplication only, so Postgres keeps it exact (division could round)."""


def from_micro(amount: Decimal | int | None) -> Decimal:
    """Divide a ``COST_MICRO_SQL`` sum by one million, exactly."""
    with localcontext() as ctx:
        ctx.prec = 60
        return Decimal(amount or 0).scaleb(MILLION_EXP)


def money_str(amount: Decimal) -> str:
    """Plain decimal notation without trailing zeros (never exponent form)."""
    text = format(amount, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text or "0"


@dataclass(frozen=True, slots=True)
class Price:
    effective_from: date
    prompt: Decimal
    cached_prompt: Decimal
    completion: Decimal

    def cost(self, *, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> Decimal:
        micro = (
            (prompt_tokens - cached_tokens) * self.prompt
            + cached_tokens * self.cached_prompt
            + completion_tokens * self.completion
        )
        return from_micro(micro)


class PriceBook:
    """Prices cached in process for spend budgets; refreshed every ``refresh_s`` (the reports use SQL)."""

    def __init__(self, *, engine: AsyncEngine, refresh_s: float = 30.0) -> None:
        self.engine = engine
        self.refresh_s = refresh_s
        self._by_model: dict[str, list[Price]] = {}
        self._loaded_at = float("-inf")
        self.version = 0
        """Counts the loads: what was worked out from the prices before a change is stale."""

    def due(self) -> bool:
        """Time to load the prices again (``refresh`` would query Postgres)."""
        return time.monotonic() - self._loaded_at >= self.refresh_s

    async def refresh(self, *, force: bool = False) -> None:
        if not force and not self.due():
            return
        self._loaded_at = time.monotonic()  # also on failure: do not hammer a Postgres that is down
        async with self.engine.connect() as conn:
            rows = (await conn.execute(select(ModelPrice).order_by(ModelPrice.effective_from))).all()
        by_model: dict[str, list[Price]] = {}
        for row in rows:
            by_model.setdefault(row.model, []).append(
                Price(
                    row.effective_from,
                    row.prompt_per_mtok,
                    row.cached_prompt_per_mtok,
                    row.completion_per_mtok,
                )
            )
        self._by_model = by_model
        self.version += 1

    def price(self, model: str, day: date) -> Price | None:
        prices = self._by_model.get(model)
        if not prices:
            return None
        i = bisect.bisect_right([p.effective_from for p in prices], day)
        return prices[i - 1] if i else None

    def cost(
        self, *, model: str, day: date, prompt_tokens: int, cached_tokens: int, completion_tokens: int
    ) -> Decimal:
        price = self.price(model, day)
        if price is None:
            return Decimal(0)
        return price.cost(
            prompt_tokens=prompt_tokens, cached_tokens=cached_tokens, completion_tokens=completion_tokens
        )
