"""Concurrency slots of a gateway process that died are freed at the next refusal, not after the slot
TTL; a live process's slots never are. Real Redis, two limiters as two processes would have."""

from __future__ import annotations

from collections.abc import AsyncIterator
from decimal import Decimal

import pytest
from redis.asyncio import Redis
from test_limits import key_scope, make_limiter, only

from gateway.errors import OpenAIError
from gateway.limits.liveness import Liveness
from gateway.limits.recovery import LimitsRecovery
from gateway.usage.recorder import Recovered
from gateway.wiring import create_limits_redis

pytestmark = pytest.mark.anyio


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[Redis]:
    client = create_limits_redis(redis_url)
    yield client
    await client.aclose()


async def test_slots_of_a_dead_gateway_are_freed_and_a_live_ones_are_not(redis_client: Redis) -> None:
    dead, live = make_limiter(redis_client), make_limiter(redis_client)
    dead_beat = Liveness(redis_client, instance_id=dead.instance_id, ttl_s=600)
    live_beat = Liveness(redis_client, instance_id=live.instance_id, ttl_s=600)
    await dead_beat.start()
    await live_beat.start()
    limits = only(key_scope(concurrency=2))
    try:
        await dead.admit(limits=limits, reserve=1)
        await live.admit(limits=limits, reserve=1)
        with pytest.raises(OpenAIError) as refused:  # both holders live: the key is full
            await live.admit(limits=limits, reserve=1)
        assert refused.value.code == "concurrency_limit_exceeded"

        # The first process dies (SIGKILL: nothing settled); its successor replayed its journal.
        dead_beat._task.cancel()  # type: ignore[union-attr]
        await LimitsRecovery(redis=redis_client, liveness=live_beat)(
            Recovered(records=[], new=0, instances=frozenset({dead.instance_id}))
        )
        assert (await live.admit(limits=limits, reserve=1)).backend == "redis"  # its slot was freed
        with pytest.raises(OpenAIError):  # and only its: the two live requests still hold theirs
            await live.admit(limits=limits, reserve=1)
    finally:
        await dead_beat.stop()
        await live_beat.stop()


async def test_budget_reservations_of_a_dead_gateway_are_given_back_and_a_live_ones_are_not(
    redis_client: Redis,
) -> None:
    from gateway.budgets.rules import BudgetRule
    from gateway.limits.schemas import RequestLimits, Scope

    async def nothing_used(*_: object) -> tuple[int, Decimal]:
        return 0, Decimal(0)

    dead, live = make_limiter(redis_client), make_limiter(redis_client)
    dead.load_usage = live.load_usage = nothing_used
    dead_beat = Liveness(redis_client, instance_id=dead.instance_id, ttl_s=600)
    live_beat = Liveness(redis_client, instance_id=live.instance_id, ttl_s=600)
    await dead_beat.start()
    await live_beat.start()
    budget = BudgetRule.of(metric="tokens", period="day", amount=100)
    limits = RequestLimits(
        scopes=(Scope(kind="key", id="k1", label="k", budgets=(budget,)),), failure_policy="closed"
    )
    try:
        await dead.admit(limits=limits, reserve=40)
        await live.admit(limits=limits, reserve=40)
        with pytest.raises(OpenAIError) as refused:  # 80 held by live requests: 40 more do not fit
            await live.admit(limits=limits, reserve=40)
        assert refused.value.code == "insufficient_quota"

        dead_beat._task.cancel()  # type: ignore[union-attr]  # SIGKILL: the reservation never settles
        await LimitsRecovery(redis=redis_client, liveness=live_beat)(
            Recovered(records=[], new=0, instances=frozenset({dead.instance_id}))
        )
        assert (await live.admit(limits=limits, reserve=40)).backend == "redis"  # the dead one's is back
        with pytest.raises(OpenAIError):  # and only it: the live ones still hold 80
            await live.admit(limits=limits, reserve=40)
    finally:
        await dead_beat.stop()
        await live_beat.stop()
