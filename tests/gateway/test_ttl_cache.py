"""TtlCache: hits within the TTL, one shared load for concurrent misses, and nothing older than the
TTL (counted from when its load started), including after forget() during a load."""

from __future__ import annotations

import asyncio

import pytest

from gateway.ttl_cache import TtlCache

pytestmark = pytest.mark.anyio


class Source:
    """Answers with a version number that the test bumps, like a row being updated."""

    def __init__(self) -> None:
        self.version = 0
        self.loads = 0
        self.release = asyncio.Event()
        self.release.set()
        self.started = asyncio.Event()

    async def load(self) -> int:
        self.loads += 1
        seen = self.version
        self.started.set()
        await self.release.wait()
        return seen


async def test_concurrent_misses_share_one_load() -> None:
    cache: TtlCache[str, int] = TtlCache(ttl_s=60)
    source = Source()
    source.release.clear()
    waiters = [asyncio.ensure_future(cache.get("k", source.load)) for _ in range(20)]
    await asyncio.sleep(0)
    source.release.set()
    assert await asyncio.gather(*waiters) == [0] * 20
    assert source.loads == 1
    assert await cache.get("k", source.load) == 0 and source.loads == 1  # a hit


async def test_entries_expire_after_the_ttl() -> None:
    cache: TtlCache[str, int] = TtlCache(ttl_s=0.05)
    source = Source()
    assert await cache.get("k", source.load) == 0
    source.version = 1
    await asyncio.sleep(0.06)
    assert await cache.get("k", source.load) == 1 and source.loads == 2


async def test_a_cancelled_caller_does_not_cancel_the_shared_load() -> None:
    cache: TtlCache[str, int] = TtlCache(ttl_s=60)
    source = Source()
    source.release.clear()
    first = asyncio.ensure_future(cache.get("k", source.load))
    second = asyncio.ensure_future(cache.get("k", source.load))
    await asyncio.sleep(0)
    first.cancel()
    source.release.set()
    assert await second == 0 and source.loads == 1


async def test_forget_during_a_load_keeps_its_old_value_out_of_the_cache() -> None:
    cache: TtlCache[str, int] = TtlCache(ttl_s=60)
    source = Source()
    source.release.clear()
    loading = asyncio.ensure_future(cache.get("k", source.load))
    await source.started.wait()  # the load has read version 0
    source.version = 1  # e.g. the key is revoked while the lookup runs...
    cache.forget("k")  # ...by this process, which drops its entry at once
    source.release.set()
    assert await loading == 0  # that caller raced the change
    assert await cache.get("k", source.load) == 1  # but the stale answer was not cached


async def test_failures_are_not_cached_and_stale_values_stay_readable() -> None:
    cache: TtlCache[str, int] = TtlCache(ttl_s=0)
    source = Source()
    assert await cache.get("k", source.load) == 0
    assert cache.stale("k") is None  # ttl 0: nothing is kept

    async def broken() -> int:
        raise ConnectionError("down")

    cache = TtlCache(ttl_s=60)
    assert await cache.get("k", source.load) == 0
    cache.forget("k")
    with pytest.raises(ConnectionError):
        await cache.get("k", broken)
    assert await cache.get("k", source.load) == 0 and source.loads == 3
