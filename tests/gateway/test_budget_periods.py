"""Budget periods against a real Redis and Postgres, with a clock the test moves: a day budget resets
at 00:00 UTC, a week budget on Monday, a month budget on the 1st, a total budget never; and within
a period, counters that Redis lost are seeded again from the usage rows in Postgres."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, date, datetime
from decimal import Decimal

import pytest
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from gateway.budgets.periods import Period
from gateway.budgets.rules import BudgetRule
from gateway.errors import OpenAIError
from gateway.limits.config import LimitsSettings
from gateway.limits.limiter import RateLimiter
from gateway.limits.schemas import RequestLimits, Scope
from gateway.reports.service import period_usage
from gateway.usage.batch_writer import write_batch
from gateway.usage.schemas import UsageRecord
from gateway.wiring import create_limits_redis

pytestmark = pytest.mark.anyio

BUDGET = 100


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


@pytest.fixture
async def db_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(database_url)
    yield engine
    await engine.dispose()


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[Redis]:
    client = create_limits_redis(redis_url)
    yield client
    await client.aclose()


class Clock:
    def __init__(self) -> None:
        self.now = at("2026-01-01T00:00:00")

    def __call__(self) -> datetime:
        return self.now


def limiter_on(redis: Redis, db_engine: AsyncEngine, clock: Clock) -> RateLimiter:
    async def load_usage(scope: Scope, start: date, end: date | None) -> tuple[int, Decimal]:
        return await period_usage(db_engine, column="key_id", owner_id=scope.id, start=start, end=end)

    return RateLimiter(redis=redis, settings=LimitsSettings(), load_usage=load_usage, clock=clock)


async def use_whole_budget(limiter: RateLimiter, limits: RequestLimits, db_engine: AsyncEngine) -> None:
    """Admit and settle one request of BUDGET tokens, with its usage row in Postgres as the gateway
    would write it (started at the admission's time)."""
    admission = await limiter.admit(limits=limits, reserve=BUDGET)
    scope = limits.scopes[0]
    started = limiter.clock()
    row = UsageRecord(
        request_id=uuid.uuid4().hex,
        tenant_id=str(uuid.uuid4()),
        key_id=scope.id,
        model="m",
        endpoint="/v1/chat/completions",
        prompt_tokens=40,
        cached_tokens=0,
        completion_tokens=BUDGET - 40,
        status=200,
        finish_reason="stop",
        ttft_ms=1.0,
        duration_ms=2.0,
        started_at=started,
        finished_at=started,
    )
    assert await write_batch(db_engine, [row], known_months=set()) == 1
    await limiter.settle(admission, tokens=BUDGET)


async def refused(limiter: RateLimiter, limits: RequestLimits) -> str | None:
    """The refusal's message, or None when the request was admitted (and then settled at 0)."""
    try:
        admission = await limiter.admit(limits=limits, reserve=1)
    except OpenAIError as exc:
        assert exc.status == 429 and exc.code == "insufficient_quota"
        return exc.message
    await limiter.settle(admission, tokens=0)
    return None


# (period, when the budget is used up, the last second of that period, the first of the next)
CASES: list[tuple[Period, str, str, str | None, str]] = [
    ("day", "2026-03-31T10:00:00", "2026-03-31T23:59:59", "2026-04-01T00:00:00", "2026-04-01T00:00:00Z"),
    # Saturday, then Sunday night (the same week), then Monday
    ("week", "2026-04-04T10:00:00", "2026-04-05T23:59:59", "2026-04-06T00:00:00", "2026-04-06T00:00:00Z"),
    ("month", "2026-04-02T10:00:00", "2026-04-30T23:59:59", "2026-05-01T00:00:00", "2026-05-01T00:00:00Z"),
    ("total", "2026-04-02T10:00:00", "2030-12-31T23:59:59", None, "does not reset"),
]


@pytest.mark.parametrize(("period", "used_at", "last_second", "next_period", "reset_text"), CASES)
async def test_a_budget_resets_at_the_start_of_its_next_period_and_reseeds_from_postgres(
    redis_client: Redis,
    db_engine: AsyncEngine,
    period: Period,
    used_at: str,
    last_second: str,
    next_period: str | None,
    reset_text: str,
) -> None:
    clock = Clock()
    limiter = limiter_on(redis_client, db_engine, clock)
    scope = Scope(
        kind="key",
        id=str(uuid.uuid4()),
        label="API key 'k'",
        budgets=(BudgetRule.of(metric="tokens", period=period, amount=BUDGET),),
    )
    limits = RequestLimits(scopes=(scope,), failure_policy="closed")

    clock.now = at(used_at)
    await use_whole_budget(limiter, limits, db_engine)
    message = await refused(limiter, limits)
    assert message is not None and reset_text in message, message

    clock.now = at(last_second)
    assert await refused(limiter, limits) is not None
    # Redis restarts empty: the period's usage is read back from Postgres, so still refused.
    await redis_client.flushall()
    assert await refused(limiter, limits) is not None

    if next_period is not None:
        clock.now = at(next_period)
        assert await refused(limiter, limits) is None


async def test_several_budgets_at_once_each_counts_in_its_own_period(
    redis_client: Redis, db_engine: AsyncEngine
) -> None:
    """A day budget and a week budget together: the day resets at midnight, but the week, used up over
    two days, still refuses until Monday."""
    clock = Clock()
    limiter = limiter_on(redis_client, db_engine, clock)
    scope = Scope(
        kind="key",
        id=str(uuid.uuid4()),
        label="API key 'k'",
        budgets=(
            BudgetRule.of(metric="tokens", period="day", amount=BUDGET),
            BudgetRule.of(metric="tokens", period="week", amount=2 * BUDGET),
        ),
    )
    limits = RequestLimits(scopes=(scope,), failure_policy="closed")
    clock.now = at("2026-04-07T12:00:00")  # a Tuesday
    await use_whole_budget(limiter, limits, db_engine)
    assert "daily token budget" in (await refused(limiter, limits) or "")
    clock.now = at("2026-04-08T12:00:00")
    await use_whole_budget(limiter, limits, db_engine)
    clock.now = at("2026-04-09T12:00:00")  # a fresh day, but the week has 2 x BUDGET
    assert "weekly token budget" in (await refused(limiter, limits) or "")
    await redis_client.flushall()
    assert "weekly token budget" in (await refused(limiter, limits) or "")
    clock.now = at("2026-04-13T00:00:00")  # Monday
    assert await refused(limiter, limits) is None


async def test_a_reservation_that_never_settles_expires(redis_client: Redis, db_engine: AsyncEngine) -> None:
    """A request whose gateway died holds its worst case only until TERN_LIMITS_SLOT_TTL_S passes."""
    clock = Clock()
    limiter = limiter_on(redis_client, db_engine, clock)
    limiter.settings = LimitsSettings(slot_ttl_s=0.3)
    scope = Scope(
        kind="key",
        id=str(uuid.uuid4()),
        label="API key 'k'",
        budgets=(BudgetRule.of(metric="tokens", period="total", amount=BUDGET),),
    )
    limits = RequestLimits(scopes=(scope,), failure_policy="closed")
    await limiter.admit(limits=limits, reserve=BUDGET)  # never settled
    assert await refused(limiter, limits) is not None
    deadline = time.monotonic() + 10
    while await refused(limiter, limits) is not None:  # Redis's clock decides when it expires
        assert time.monotonic() < deadline, "the reservation never expired"
        await asyncio.sleep(0.1)
