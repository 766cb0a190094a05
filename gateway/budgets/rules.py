"""A budget as admission checks it: :class:`BudgetRule`, in integer units (tokens, or nano-units of
money). Its period's counter in Redis is named by ``gateway/keyspace.py``."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Literal

from gateway.budgets.periods import Period

NANO = Decimal(10) ** 9
"""Spend is kept in Redis as integer nano-units of the price currency: no floats near money."""

Metric = Literal["tokens", "spend"]
PERIOD_ADJECTIVE: dict[Period, str] = {"day": "daily", "week": "weekly", "month": "monthly", "total": "total"}


def to_nano(amount: Decimal) -> int:
    """Rounded up: counters built from costs never run below the exact cost Postgres bills."""
    return int((amount * NANO).to_integral_value(rounding=ROUND_CEILING))


def from_nano(nano: int) -> Decimal:
    """Exact; 9 decimals at most, trailing zeros dropped (never exponent form under ``format(x, "f")``)."""
    amount = Decimal(nano).scaleb(-9)
    return amount.quantize(Decimal(1)) if amount == amount.to_integral_value() else amount.normalize()


PRICE_SCALE = 10**10
"""Prices per million tokens have 10 decimals (``Numeric(20, 10)``): times this, they are integers."""


def nano_cost(
    prompt_price: int, cached_price: int, completion_price: int, *, prompt: int, cached: int, completion: int
) -> int:
    """A request's cost in nano-units, rounded up (as :func:`to_nano` rounds the ``Decimal`` cost),
    from prices per million tokens scaled by :data:`PRICE_SCALE`: integer arithmetic only, exact.
    cost = tokens x price / 1e6 money = tokens x price x 1e3 nano = tokens x scaled / 1e7 nano."""
    scaled = (prompt - cached) * prompt_price + cached * cached_price + completion * completion_price
    return -(-scaled // 10**7)


def nano_str(nano: int) -> str:
    """A non-negative nano-unit amount as a plain decimal string ("0.002"), without ``Decimal``."""
    whole, frac = divmod(nano, 10**9)
    return f"{whole}.{frac:09d}".rstrip("0").rstrip(".")


@dataclass(frozen=True, slots=True)
class BudgetRule:
    metric: Metric
    period: Period
    limit: int
    """Tokens, or spend in nano-units."""
    alert_at: int | None = None
    """The soft threshold in the same units; None: no alert."""
    budget_id: int | None = None
    """The ``budgets`` row; None: a ``monthly_*_budget`` field of the key or tenant limits."""

    @classmethod
    def of(
        cls,
        *,
        metric: Metric,
        period: Period,
        amount: Decimal | int,
        alert_ratio: Decimal | None = None,
        budget_id: int | None = None,
    ) -> BudgetRule:
        limit = int(amount) if metric == "tokens" else to_nano(Decimal(amount))
        alert_at = None if alert_ratio is None else int(Decimal(limit) * alert_ratio)
        return cls(metric=metric, period=period, limit=limit, alert_at=alert_at, budget_id=budget_id)

    @property
    def code(self) -> int:
        """0 for tokens, 1 for spend (the scripts' encoding)."""
        return 0 if self.metric == "tokens" else 1

    def describe(self) -> str:
        amount = f"{self.limit} tokens" if self.metric == "tokens" else format(from_nano(self.limit), "f")
        what = "token" if self.metric == "tokens" else "spend"
        return f"{PERIOD_ADJECTIVE[self.period]} {what} budget of {amount}"

    @property
    def name(self) -> str:
        """For metrics labels and alerts: ``tokens:day``."""
        return f"{self.metric}:{self.period}"
