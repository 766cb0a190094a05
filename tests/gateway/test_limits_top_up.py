"""Topping a reservation up to the prompt's exact count (``scripts/topup.lua``), against a real Redis:
it grows the request's hold on every tpm window and budget of every scope at once, or refuses and
changes nothing, and settling gives back what was topped up."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import date
from decimal import Decimal

import pytest
from redis.asyncio import Redis

from gateway.budgets.rules import BudgetRule
from gateway.errors import OpenAIError
from gateway.limits.config import LimitsSettings
from gateway.limits.denials import TokensRefused
from gateway.limits.limiter import RateLimiter
from gateway.limits.schemas import RequestLimits, Scope
from gateway.wiring import create_limits_redis
from tern_stack.services import free_port

pytestmark = pytest.mark.anyio


async def nothing_used(scope: Scope, start: date, end: date | None) -> tuple[int, Decimal]:
    return 0, Decimal(0)


@pytest.fixture
async def limiter(redis_url: str) -> AsyncIterator[RateLimiter]:
    client: Redis = create_limits_redis(redis_url)
    yield RateLimiter(redis=client, settings=LimitsSettings(), load_usage=nothing_used)
    await client.aclose()


def limits(
    *, tpm: int | None = None, key_budget: int | None = None, tenant_budget: int | None = None
) -> RequestLimits:
    owner = uuid.uuid4().hex  # fresh counters and windows per test

    def budgets(amount: int | None) -> tuple[BudgetRule, ...]:
        return () if amount is None else (BudgetRule.of(metric="tokens", period="total", amount=amount),)

    key = Scope(kind="key", id=owner, label="API key 'k'", tpm=tpm, budgets=budgets(key_budget))
    tenant = Scope(kind="tenant", id=owner, label="this tenant", budgets=budgets(tenant_budget))
    scopes = tuple(s for s in (key, tenant) if s.is_limited)
    return RequestLimits(scopes=scopes, failure_policy="closed")


async def test_a_top_up_holds_more_in_every_budget_or_refuses_and_changes_nothing(
    limiter: RateLimiter,
) -> None:
    both = limits(key_budget=100, tenant_budget=80)
    first = await limiter.admit(limits=both, reserve=30)
    assert first.budget_tokens_left == 70
    await limiter.top_up(first, tokens=70, nano=0)
    assert (
        first.reserved_tokens,
        first.budget_tokens_left,
        first.headers()["x-tern-budget-remaining-tokens"],
    ) == (
        70,
        30,
        "30",
    )
    with pytest.raises(TokensRefused) as refused:  # the tenant's 80 hold 70 now
        await limiter.admit(limits=both, reserve=11)
    assert refused.value.status == 429 and refused.value.code == "insufficient_quota"
    second = await limiter.admit(limits=both, reserve=10)

    with pytest.raises(TokensRefused) as refused:
        await limiter.top_up(first, tokens=71, nano=0)
    assert "(71 tokens: prompt plus max_tokens)" in refused.value.message
    assert first.reserved_tokens == 70  # unchanged, and so is what Redis holds:
    await limiter.settle(second, tokens=0)
    await limiter.admit(limits=both, reserve=10)

    await limiter.settle(first, tokens=0)  # gives back all 70, not the 30 it was admitted with
    await limiter.admit(limits=both, reserve=70)


async def test_a_top_up_counts_in_the_tpm_window_and_is_told_when_it_can_never_fit(
    limiter: RateLimiter,
) -> None:
    window = limits(tpm=100)
    admission = await limiter.admit(limits=window, reserve=30)
    with pytest.raises(OpenAIError) as refused:
        await limiter.top_up(admission, tokens=101, nano=0)
    assert (refused.value.status, refused.value.code) == (400, "tokens_exceed_rate_limit")
    await limiter.top_up(admission, tokens=100, nano=0)
    assert admission.headers()["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(OpenAIError) as refused:
        await limiter.admit(limits=window, reserve=1)
    assert (refused.value.status, refused.value.code) == (429, "rate_limit_exceeded")
    await limiter.settle(admission, tokens=40)  # the real count replaces the topped-up reservation
    await limiter.admit(limits=window, reserve=60)


async def test_a_top_up_while_redis_is_down_counts_in_the_local_share() -> None:
    """Fail-open keys fall back to this process's share of the limits; a top-up grows it there."""
    client: Redis = create_limits_redis(f"redis://127.0.0.1:{free_port()}")  # nothing listens
    limiter = RateLimiter(redis=client, settings=LimitsSettings(), load_usage=nothing_used)
    try:
        window = RequestLimits(scopes=limits(tpm=100).scopes, failure_policy="open")
        admission = await limiter.admit(limits=window, reserve=30)
        assert admission.backend == "local"
        with pytest.raises(OpenAIError) as refused:
            await limiter.top_up(admission, tokens=101, nano=0)
        assert refused.value.status == 400
        await limiter.top_up(admission, tokens=100, nano=0)
        with pytest.raises(OpenAIError) as refused:
            await limiter.admit(limits=window, reserve=1)
        assert refused.value.status == 429
        await limiter.settle(admission, tokens=50)
        await limiter.admit(limits=window, reserve=50)
    finally:
        await client.aclose()
