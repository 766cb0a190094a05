"""The limiter against a real Redis: exact sliding windows, TPM reserve-then-settle, concurrency
slots that expire, headers, and both Redis-outage policies with recovery (a real server stopped
and restarted)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import date
from decimal import Decimal

import pytest
from redis.asyncio import Redis

from gateway.budgets.rules import BudgetRule
from gateway.errors import OpenAIError
from gateway.limits.config import LimitsSettings
from gateway.limits.limiter import RateLimiter, reserve_tokens
from gateway.limits.schemas import RequestLimits, Scope, format_reset
from gateway.wiring import create_limits_redis
from tern_stack.services import RedisServer

pytestmark = pytest.mark.anyio


async def no_budget_source(scope: Scope, start: date, end: date | None) -> tuple[int, Decimal]:
    raise AssertionError("no budgets in these tests")


def key_scope(**limits: int) -> Scope:
    return Scope(kind="key", id="k1", label="API key 'k1'", **limits)


def only(scope: Scope, policy: str = "closed") -> RequestLimits:
    return RequestLimits(scopes=(scope,), failure_policy=policy)  # type: ignore[arg-type]


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[Redis]:
    client = create_limits_redis(redis_url)
    yield client
    await client.aclose()


def make_limiter(client: Redis, **settings: object) -> RateLimiter:
    return RateLimiter(redis=client, settings=LimitsSettings(**settings), load_usage=no_budget_source)


async def admit_many(
    limiter: RateLimiter, limits: RequestLimits, n: int, reserve: int = 1
) -> tuple[int, int]:
    async def one() -> bool:
        try:
            await limiter.admit(limits=limits, reserve=reserve)
            return True
        except OpenAIError as exc:
            assert exc.status == 429
            return False

    results = await asyncio.gather(*(one() for _ in range(n)))
    return sum(results), n - sum(results)


async def test_rpm_is_exact_under_concurrency_and_shared_by_limiters(redis_client: Redis) -> None:
    """Two limiters (as two processes would have) share one window through Redis."""
    a, b = make_limiter(redis_client), make_limiter(redis_client)
    limits = only(key_scope(rpm=50))
    (admitted_a, _), (admitted_b, _) = await asyncio.gather(
        admit_many(a, limits, 150), admit_many(b, limits, 150)
    )
    assert admitted_a + admitted_b == 50


async def test_429_says_why_and_carries_retry_after_and_headers(redis_client: Redis) -> None:
    limiter = make_limiter(redis_client)
    limits = only(key_scope(rpm=2, tpm=1000))
    first = await limiter.admit(limits=limits, reserve=100)
    second = await limiter.admit(limits=limits, reserve=100)
    headers = second.headers()
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-tokens"] == "800"
    assert first.headers()["x-ratelimit-remaining-requests"] == "1"
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    with pytest.raises(OpenAIError) as denied:
        await limiter.admit(limits=limits, reserve=100)
    assert denied.value.status == 429
    assert "2 requests per minute" in denied.value.message
    assert 1 <= int(denied.value.headers["retry-after"]) <= 60
    assert denied.value.headers["x-ratelimit-remaining-requests"] == "0"


async def test_tpm_reserves_then_settles_with_the_real_count(redis_client: Redis) -> None:
    limiter = make_limiter(redis_client)
    limits = only(key_scope(tpm=250))
    first = await limiter.admit(limits=limits, reserve=100)
    await limiter.admit(limits=limits, reserve=100)
    with pytest.raises(OpenAIError) as denied:  # 200 reserved + 100 > 250
        await limiter.admit(limits=limits, reserve=100)
    assert "250 tokens per minute" in denied.value.message and denied.value.headers["retry-after"]
    await limiter.settle(first, tokens=10)  # the first request used 10 tokens, not 100
    third = await limiter.admit(limits=limits, reserve=100)
    assert third.headers()["x-ratelimit-remaining-tokens"] == str(250 - 10 - 100 - 100)
    await limiter.settle(first, tokens=10)  # settling twice changes nothing
    assert third.headers()["x-ratelimit-remaining-tokens"] == "40"
    with pytest.raises(OpenAIError):
        await limiter.admit(limits=limits, reserve=41)


async def test_a_request_larger_than_the_tpm_limit_is_a_400_not_a_retry(redis_client: Redis) -> None:
    limiter = make_limiter(redis_client)
    with pytest.raises(OpenAIError) as denied:
        await limiter.admit(limits=only(key_scope(tpm=100)), reserve=101)
    assert denied.value.status == 400 and denied.value.param == "max_tokens"


def test_reservation_caps_max_tokens_by_the_default() -> None:
    assert reserve_tokens(prompt_tokens=10, max_tokens=None, n=1, default_max_tokens=512) == 522
    assert reserve_tokens(prompt_tokens=10, max_tokens=100_000, n=1, default_max_tokens=512) == 522
    assert reserve_tokens(prompt_tokens=10, max_tokens=20, n=3, default_max_tokens=512) == 70


async def test_window_slides(redis_client: Redis) -> None:
    limiter = make_limiter(redis_client, window_s=0.5)
    limits = only(key_scope(rpm=1, tpm=10))
    await limiter.admit(limits=limits, reserve=10)
    with pytest.raises(OpenAIError):
        await limiter.admit(limits=limits, reserve=1)
    await asyncio.sleep(0.6)  # the first request leaves the window, with its tokens
    admission = await limiter.admit(limits=limits, reserve=10)
    assert admission.headers()["x-ratelimit-remaining-tokens"] == "0"


async def test_concurrency_slots_are_released_on_settle_and_expire_after_a_crash(redis_client: Redis) -> None:
    limiter = make_limiter(redis_client, slot_ttl_s=0.5)
    limits = only(key_scope(concurrency=1))
    first = await limiter.admit(limits=limits, reserve=1)
    with pytest.raises(OpenAIError) as denied:
        await limiter.admit(limits=limits, reserve=1)
    assert denied.value.status == 429 and "concurrent" in denied.value.message
    assert denied.value.headers["retry-after"]
    await limiter.settle(first, tokens=0)  # finished (or failed): slot back at once
    await limiter.admit(limits=limits, reserve=1)  # ... and this one "crashes": never settled
    with pytest.raises(OpenAIError):
        await limiter.admit(limits=limits, reserve=1)
    await asyncio.sleep(0.6)
    await limiter.admit(limits=limits, reserve=1)  # the crashed request's slot expired


async def test_a_denial_by_one_scope_records_nothing_in_the_others(redis_client: Redis) -> None:
    limiter = make_limiter(redis_client)
    key = key_scope(rpm=10)
    tenant = Scope(kind="tenant", id="t1", label="this tenant", rpm=1)
    both = RequestLimits(scopes=(key, tenant), failure_policy="closed")
    await limiter.admit(limits=both, reserve=1)
    for _ in range(3):
        with pytest.raises(OpenAIError) as denied:
            await limiter.admit(limits=both, reserve=1)
        assert "this tenant" in denied.value.message
    admission = await limiter.admit(limits=only(key), reserve=1)
    assert admission.headers()["x-ratelimit-remaining-requests"] == "8"  # 10 - 2 admitted


def test_reset_durations_use_openai_style() -> None:
    assert format_reset(20) == "20ms"
    assert format_reset(1500) == "1.5s"
    assert format_reset(360_000) == "6m0s"
    assert format_reset(61_250) == "1m1.25s"


# ---------------------------------------------------------------- Redis outages


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis of this test's own, so stopping it disturbs nobody else."""
    server = RedisServer().start()
    yield server
    server.stop()


async def wait_until(predicate, within_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


@asynccontextmanager
async def redis_restarted(port: int, limiter: RateLimiter, limits: RequestLimits) -> AsyncIterator[None]:
    """Start Redis again on its old port and wait until the limiter is back on it."""
    restarted = RedisServer(port=port).start()
    try:

        async def back() -> bool:
            try:
                return (await limiter.admit(limits=limits, reserve=1)).backend == "redis"
            except OpenAIError:
                return False

        await wait_until(back)
        yield
    finally:
        await limiter.redis.aclose()
        restarted.stop()


async def test_redis_outage_fail_closed_then_recovers(own_redis: RedisServer) -> None:
    client = create_limits_redis(own_redis.url())
    limiter = make_limiter(client, redis_retry_s=0.2)
    limits = only(key_scope(rpm=100), policy="closed")
    assert (await limiter.admit(limits=limits, reserve=1)).backend == "redis"

    port = own_redis.port
    own_redis.stop()
    with pytest.raises(OpenAIError) as refused:
        await limiter.admit(limits=limits, reserve=1)
    assert refused.value.status == 503 and "fail closed" in refused.value.message
    assert refused.value.headers["retry-after"]

    async with redis_restarted(port, limiter, limits):
        pass


async def test_redis_outage_fail_open_uses_a_local_share_then_recovers(own_redis: RedisServer) -> None:
    client = create_limits_redis(own_redis.url())
    limiter = make_limiter(client, redis_retry_s=0.2, replicas=4)
    limits = only(key_scope(rpm=40), policy="open")
    port = own_redis.port
    own_redis.stop()

    admitted, denied = await admit_many(limiter, limits, 30)
    assert (admitted, denied) == (10, 20)  # 40 rpm / 4 replicas, never unlimited

    async with redis_restarted(port, limiter, limits):
        # Back on the shared window: Redis (restarted empty) now counts from scratch, to 40.
        admitted, _ = await admit_many(limiter, limits, 60)
        assert admitted == 39


async def test_redis_outage_fail_open_checks_budgets_against_the_last_counts_settled(
    own_redis: RedisServer,
) -> None:
    """The local fallback refuses by the budget counters the Redis settlements last returned (two
    budgets of one metric, different periods, each its own count), not by a fresh read that does
    not know them."""
    client = create_limits_redis(own_redis.url())

    async def nothing_billed_yet(scope: Scope, start: date, end: date | None) -> tuple[int, Decimal]:
        return 0, Decimal(0)

    day = BudgetRule.of(metric="tokens", period="day", amount=100)
    month = BudgetRule.of(metric="tokens", period="month", amount=1000)
    limits = only(Scope(kind="key", id="k1", label="API key 'k1'", budgets=(day, month)), policy="open")
    limiter = RateLimiter(
        redis=client, settings=LimitsSettings(redis_retry_s=60), load_usage=nothing_billed_yet
    )
    try:
        admission = await limiter.admit(limits=limits, reserve=10)
        await limiter.settle(admission, tokens=95)  # the day's counter: 95 of 100
        own_redis.stop()
        with pytest.raises(OpenAIError) as refused:
            await limiter.admit(limits=limits, reserve=10)
        assert refused.value.status == 429 and "daily token budget" in refused.value.message
        assert (await limiter.admit(limits=limits, reserve=5)).backend == "local"  # 100 fits the day
    finally:
        await client.aclose()


async def test_the_used_ratio_gauge_is_set_when_it_moved_by_a_step(redis_client: Redis) -> None:
    """Setting a gauge takes a lock: a settlement that moves a budget's ratio by less than
    GAUGE_STEP since it was last set leaves it; one that moves it further sets it."""
    await redis_client.flushall()
    gauged: list[tuple[str, float]] = []

    async def nothing_billed_yet(scope: Scope, start: date, end: date | None) -> tuple[int, Decimal]:
        return 0, Decimal(0)

    limiter = RateLimiter(
        redis=redis_client,
        settings=LimitsSettings(),
        load_usage=nothing_billed_yet,
        on_used=lambda label, ratio: gauged.append((label, ratio)),
    )
    budget = BudgetRule.of(metric="tokens", period="day", amount=1_000_000)
    limits = only(Scope(kind="key", id="k1", label="API key 'k1'", budgets=(budget,)))
    for tokens in (10, 10, 1000, 5):  # used: 10, 20 (+0.00001), 1020 (+0.00101), 1025
        await limiter.settle(await limiter.admit(limits=limits, reserve=tokens), tokens=tokens)
    assert gauged == [("key:k1:tokens:day", 0.00001), ("key:k1:tokens:day", 0.00102)]
