"""A per-process cache whose entries live at most ``ttl_s``, loading each missing key once.

Used on the request path (API keys, limit rows) so a hot key costs no query most of the time.
Concurrent misses for the same key share one load instead of each querying the database (at
64 concurrent requests, an expiring entry would otherwise cost 64 identical queries). An entry's
age counts from when its load *started*, and a load older than ``ttl_s`` is never joined, so no
caller ever sees data older than ``ttl_s`` plus its own query time: the bound revocation relies on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TtlCache(Generic[K, V]):
    def __init__(self, *, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[K, tuple[float, V]] = {}
        self._loading: dict[K, tuple[float, asyncio.Task[V]]] = {}
        self._generation = 0
        """Bumped by forget(): a load that started before it must not store its (older) value."""

    async def get(self, key: K, load: Callable[[], Awaitable[V]]) -> V:
        """The cached value, or ``await load()`` (shared with concurrent callers for the same key)."""
        now = time.monotonic()
        entry = self._entries.get(key)
        if entry is not None and now - entry[0] < self.ttl_s:
            return entry[1]
        pending = self._loading.get(key)
        if pending is None or now - pending[0] >= self.ttl_s:
            task = asyncio.get_running_loop().create_task(self._load(key, load, started=now))
            task.add_done_callback(_retrieve_exception)
            pending = self._loading[key] = (now, task)
        # Shielded: a caller that is cancelled (client gone) does not cancel the others' load.
        return await asyncio.shield(pending[1])

    def stale(self, key: K) -> V | None:
        """The last value loaded for ``key`` however old (a fallback while the source is down)."""
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def forget(self, key: K | None = None) -> None:
        """Drop one entry (or all) at once, e.g. after a change made through this process."""
        self._generation += 1
        if key is None:
            self._entries.clear()
            self._loading.clear()
        else:
            self._entries.pop(key, None)
            self._loading.pop(key, None)

    async def _load(self, key: K, load: Callable[[], Awaitable[V]], *, started: float) -> V:
        generation = self._generation
        try:
            value = await load()
        finally:
            current = self._loading.get(key)
            if current is not None and current[1] is asyncio.current_task():
                del self._loading[key]
        if self.ttl_s > 0 and generation == self._generation:
            if len(self._entries) >= self.max_entries:
                self._evict(time.monotonic())
            self._entries[key] = (started, value)
        return value

    def _evict(self, now: float) -> None:
        stale = [key for key, (at, _) in self._entries.items() if now - at >= self.ttl_s]
        for key in stale:
            del self._entries[key]
        if len(self._entries) >= self.max_entries:
            self._entries.clear()


def _retrieve_exception(task: asyncio.Task[object]) -> None:
    """Every waiter may have gone; mark the failure as seen so asyncio does not log it as lost."""
    if not task.cancelled():
        task.exception()
