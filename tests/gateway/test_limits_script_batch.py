"""ScriptBatcher against a real Redis: concurrent script calls share one pipeline, each caller gets
its own reply or error, and a script Redis forgot (SCRIPT FLUSH, a restart) is loaded again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from gateway.limits.script_batch import ScriptBatcher
from gateway.metering import create_limits_redis

pytestmark = pytest.mark.anyio

INCR_BY = "return redis.call('INCRBY', KEYS[1], ARGV[1])"
FAIL_ON_NEGATIVE = "if tonumber(ARGV[1]) < 0 then return redis.error_reply('negative') end return ARGV[1]"


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[Redis]:
    client = create_limits_redis(redis_url)
    yield client
    await client.aclose()


async def test_concurrent_calls_share_a_pipeline_and_get_their_own_replies(redis_client: Redis) -> None:
    script = redis_client.register_script(INCR_BY)
    await script(keys=["counter"], args=[0])  # loaded
    batcher = ScriptBatcher(redis_client)
    sent = []
    original_pipeline = redis_client.pipeline

    def counting_pipeline(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        sent.append(1)
        return original_pipeline(*args, **kwargs)

    redis_client.pipeline = counting_pipeline  # type: ignore[method-assign]
    replies = await asyncio.gather(*(batcher.call(script, keys=["counter"], args=[1]) for _ in range(50)))
    assert sorted(replies) == list(range(1, 51))  # every increment ran once, each caller saw its own
    assert len(sent) == 1  # one round trip for the 50 calls made in one loop turn
    assert int(await redis_client.get("counter")) == 50


async def test_errors_reach_only_their_caller(redis_client: Redis) -> None:
    script = redis_client.register_script(FAIL_ON_NEGATIVE)
    batcher = ScriptBatcher(redis_client)
    results = await asyncio.gather(
        *(batcher.call(script, keys=[], args=[n]) for n in (1, -1, 2)), return_exceptions=True
    )
    assert results[0] == b"1" and results[2] == b"2"
    assert isinstance(results[1], ResponseError) and "negative" in str(results[1])


async def test_a_forgotten_script_is_loaded_again(redis_client: Redis) -> None:
    script = redis_client.register_script(INCR_BY)
    batcher = ScriptBatcher(redis_client)
    assert await batcher.call(script, keys=["n"], args=[5]) == 5
    await redis_client.script_flush()
    replies = await asyncio.gather(*(batcher.call(script, keys=["n"], args=[1]) for _ in range(3)))
    assert sorted(replies) == [6, 7, 8]


async def test_a_call_does_not_wait_for_a_batch_in_flight(redis_client: Redis) -> None:
    """A later call goes out in its own pipeline at once, not after the earlier batch's reply."""
    busy = redis_client.register_script("for i = 1, tonumber(ARGV[1]) do end return 1")  # holds Redis a while
    quick = redis_client.register_script("return 2")
    await busy(keys=[], args=[1])
    await quick(keys=[], args=[])
    batcher = ScriptBatcher(redis_client)
    in_flight, most = 0, 0
    sent = asyncio.Event()
    original_pipeline = redis_client.pipeline

    def tracking_pipeline(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        pipe = original_pipeline(*args, **kwargs)
        execute = pipe.execute

        async def tracked_execute(*a: object, **k: object) -> list[object]:
            nonlocal in_flight, most
            in_flight += 1
            most = max(most, in_flight)
            sent.set()
            try:
                return await execute(*a, **k)
            finally:
                in_flight -= 1

        pipe.execute = tracked_execute  # type: ignore[method-assign]
        return pipe

    redis_client.pipeline = tracking_pipeline  # type: ignore[method-assign]
    slow = asyncio.ensure_future(batcher.call(busy, keys=[], args=[5_000_000]))
    await sent.wait()  # the first batch is on the wire
    assert await batcher.call(quick, keys=[], args=[]) == 2
    assert await slow == 1
    assert most == 2
