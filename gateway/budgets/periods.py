"""Budget periods: calendar ``day``, ``week`` (Monday to Sunday) and ``month`` in UTC, or ``total``.

Every period starts at 00:00 UTC of a day, so its usage so far is a sum of ``usage_daily`` rows and
its Redis counter is named by the first day (:func:`period_id`). A month's counter keeps the name it
had when budgets were monthly only (``YYYYMM``), so counters of the running month carry over.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from typing import Literal

Period = Literal["day", "week", "month", "total"]
EPOCH = date(1970, 1, 1)
"""Where a ``total`` budget's period begins."""

COUNTER_TTL_S: dict[Period, int | None] = {
    "day": 3 * 86400,
    "week": 10 * 86400,
    "month": 40 * 86400,
    "total": None,
}
"""How long a period's Redis counter lives: past its period's end, so a late settlement still finds it."""


def period_start(period: Period, day: date) -> date:
    if period == "day":
        return day
    if period == "week":
        return day - timedelta(days=day.weekday())
    if period == "month":
        return day.replace(day=1)
    return EPOCH


def period_end(period: Period, day: date) -> date | None:
    """The first day of the next period (exclusive end); None for ``total``."""
    start = period_start(period, day)
    if period == "day":
        return start + timedelta(days=1)
    if period == "week":
        return start + timedelta(days=7)
    if period == "month":
        return date(start.year + start.month // 12, start.month % 12 + 1, 1)
    return None


def period_id(period: Period, day: date) -> str:
    start = period_start(period, day)
    if period == "month":
        return f"{start.year:04d}{start.month:02d}"
    if period == "total":
        return "total"
    return f"{period[0]}{start:%Y%m%d}"


def resets_at(period: Period, day: date) -> datetime | None:
    end = period_end(period, day)
    return None if end is None else datetime.combine(end, time(0), tzinfo=UTC)
