"""Which gateway processes are alive, so the concurrency slots of a dead one are freed at once.

Each process has an instance id; every admission id it hands out starts with it
(``<instance>.<uuid>``), and so does every concurrency slot in Redis. While it lives, the process
keeps ``tern:gw:alive:<instance>`` set with a short expiry (``TERN_LIMITS_LIVENESS_TTL_S``),
refreshed at a third of it. A request refused for concurrency first frees the slots whose process
key is gone (``scripts/reap.lua``) and is admitted if that made room: a key with ``max_concurrency``
is not locked out for the slot TTL by requests that died with their gateway. A restarted gateway
deletes the keys of the processes whose journals it replayed, so it need not wait for the expiry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterable

from redis.asyncio import Redis

from gateway.keyspace import alive_key

log = logging.getLogger(__name__)


def new_instance_id() -> str:
    return uuid.uuid4().hex[:16]


class Liveness:
    def __init__(self, redis: Redis, *, instance_id: str, ttl_s: float) -> None:
        self.redis = redis
        self.instance_id = instance_id
        self.ttl_s = ttl_s
        self._task: asyncio.Task[None] | None = None

    @property
    def key(self) -> str:
        return alive_key(self.instance_id)

    async def start(self) -> None:
        await self._beat()
        self._task = asyncio.get_running_loop().create_task(self._beat_loop(), name="gateway-liveness")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):  # Redis down at shutdown: the key expires on its own
            await self.redis.delete(self.key)

    async def _beat(self) -> None:
        try:
            await self.redis.set(self.key, b"1", px=int(self.ttl_s * 1000))
        except Exception as exc:  # Redis down: admission follows the failure policies meanwhile
            log.debug("liveness heartbeat failed: %s", exc)

    async def _beat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            await self._beat()

    async def forget(self, instance_ids: Iterable[str]) -> None:
        """These processes are known dead (their journals were replayed): free their slots now."""
        keys = [alive_key(i) for i in instance_ids if i != self.instance_id]
        if keys:
            await self.redis.delete(*keys)
