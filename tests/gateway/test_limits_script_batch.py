"""ScriptBatcher against a real Redis: concurrent script calls share one round trip, each caller
gets its own reply or error, a script Redis forgot (SCRIPT FLUSH, a restart) is loaded again, and
a broken connection fails only its batch."""

from __future__ import annotations

import asyncio
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import ResponseError

from gateway.limits.script_batch import REDIS_PY_TESTED, Packed, ScriptBatcher
from gateway.wiring import create_limits_redis

pytestmark = pytest.mark.anyio

INCR_BY = "return redis.call('INCRBY', KEYS[1], ARGV[1])"
FAIL_ON_NEGATIVE = "if tonumber(ARGV[1]) < 0 then return redis.error_reply('negative') end return ARGV[1]"


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[Redis]:
    client = create_limits_redis(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every write of commands to Redis, on any connection: one per round trip."""
    sent: list[bytes] = []
    original = Connection.send_packed_command

    async def counting(self: Connection, command: object, *args: object, **kwargs: object) -> None:
        sent.append(b"".join(command) if isinstance(command, list) else command)  # type: ignore[arg-type]
        await original(self, command, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Connection, "send_packed_command", counting)
    return sent


async def test_concurrent_calls_share_a_round_trip_and_get_their_own_replies(
    redis_client: Redis, writes: list[bytes]
) -> None:
    script = redis_client.register_script(INCR_BY)
    await script(keys=["counter"], args=[0])  # loaded
    batcher = ScriptBatcher(redis_client)
    writes.clear()
    replies = await asyncio.gather(*(batcher.call(script, keys=["counter"], args=[1]) for _ in range(50)))
    assert sorted(replies) == list(range(1, 51))  # every increment ran once, each caller saw its own
    assert [w.count(b"EVALSHA") for w in writes] == [50]  # one round trip for one loop turn
    await batcher.call(script, keys=["counter"], args=[1])
    assert [w.count(b"EVALSHA") for w in writes] == [50, 1]  # the next turn's call: its own round trip
    assert int(await redis_client.get("counter")) == 51


async def test_a_kept_connection_that_redis_closed_is_reconnected(redis_client: Redis) -> None:
    """The batcher keeps its connection between batches; if Redis drops it meanwhile (a restart,
    an idle timeout), the next call reconnects instead of failing, as a pooled connection would."""
    script = redis_client.register_script(INCR_BY)
    batcher = ScriptBatcher(redis_client)
    assert await batcher.call(script, keys=["k"], args=[1]) == 1
    [kept] = batcher._idle
    await redis_client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    for _ in range(500):  # until the close reaches this side
        if await kept.can_read():
            break
        await asyncio.sleep(0.01)
    assert await batcher.call(script, keys=["k"], args=[1]) == 2


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
    send = batcher._send

    async def tracked_send(batch: list) -> None:  # type: ignore[type-arg]
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        sent.set()
        try:
            await send(batch)
        finally:
            in_flight -= 1

    batcher._send = tracked_send  # type: ignore[method-assign]
    slow = asyncio.ensure_future(batcher.call(busy, keys=[], args=[5_000_000]))
    await sent.wait()  # the first batch is on the wire
    assert await batcher.call(quick, keys=[], args=[]) == 2
    assert await slow == 1
    assert most == 2


async def test_packed_keys_and_arguments_reach_the_script_as_plain_ones(redis_client: Redis) -> None:
    """Keys and arguments encoded once (``Packed``) arrive as if passed one by one, mixed with plain
    ones in any place; also when the script must be loaded again (redis-py's own call)."""
    echo = redis_client.register_script("return table.concat(KEYS, ',') .. '|' .. table.concat(ARGV, ',')")
    batcher = ScriptBatcher(redis_client)
    keys, args = ["a", b"b:\xc3\xa9"], [1, "x y", Packed.of([-2, b"", "\u00e9"]), 30]
    expected = "a,b:\u00e9|1,x y,-2,,\u00e9,30".encode()
    assert await echo(keys=keys, args=[1, "x y", -2, b"", "\u00e9", 30]) == expected
    for _ in range(2):
        assert await batcher.call(echo, keys=Packed.of(keys), args=args) == expected
        assert await batcher.call(echo, keys=keys, args=args) == expected
        await redis_client.script_flush()


def test_redis_py_is_a_version_the_fast_path_was_tested_on() -> None:
    """ScriptBatcher writes and reads on redis-py's connection internals: another redis-py version must
    fail here (and be tested) before it is allowed in pyproject.toml."""
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    pinned = [Requirement(r) for r in pyproject["project"]["dependencies"] if Requirement(r).name == "redis"]
    assert [str(r.specifier) for r in pinned] == [str(SpecifierSet(REDIS_PY_TESTED))]
    tested = SpecifierSet(REDIS_PY_TESTED)
    assert "8.2.0" not in tested and "7.4.1" not in tested  # the check can fail
    assert redis.__version__ in tested, (
        f"redis-py {redis.__version__} is not one ScriptBatcher was tested on ({REDIS_PY_TESTED})"
    )
