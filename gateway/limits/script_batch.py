"""Lua script calls made in the same event-loop turn go to Redis as one pipeline.

Every request runs one admission script and one settlement script. Called one by one, each
costs a connection checkout, a write and a read of its own; under load most of a process's
Redis time is that overhead. Here a call only queues its script and arguments; a flush task
(started when the first call of a turn arrives) sends everything queued as one non-transactional
pipeline of EVALSHAs and hands each caller its own reply, so 64 concurrent requests cost one
round trip instead of 64. A lone request still costs one round trip, and never waits for another
batch to come back first. Each script stays atomic on
its own; batching only shares the connection and the network round trip.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

MAX_BATCH = 256

Arg = int | str | bytes
_Call = tuple[AsyncScript, Sequence[Arg], Sequence[Arg], asyncio.Future[object]]


class ScriptBatcher:
    def __init__(self, redis: Redis, *, max_batch: int = MAX_BATCH) -> None:
        self.redis = redis
        self.max_batch = max_batch
        self._queue: list[_Call] = []
        self._flushes: set[asyncio.Task[None]] = set()
        self._flush_pending = False
        """A flush task has been started but has not taken the queue yet."""

    async def call(self, script: AsyncScript, *, keys: Sequence[Arg], args: Sequence[Arg]) -> object:
        """The script's reply, or the error Redis (or the connection) raised for it."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[object] = loop.create_future()
        self._queue.append((script, keys, args, future))
        if not self._flush_pending:
            # Batches do not wait for each other: a call never queues behind another batch's
            # round trip (each in-flight batch has its own pooled connection).
            self._flush_pending = True
            task = loop.create_task(self._flush())
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)
        return await future

    async def _flush(self) -> None:
        self._flush_pending = False
        batch, self._queue = self._queue, []
        for start in range(0, len(batch), self.max_batch):
            await self._send(batch[start : start + self.max_batch])

    async def _send(self, batch: list[_Call]) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for script, keys, args, _ in batch:
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                replies = await pipe.execute(raise_on_error=False)
        except BaseException as exc:  # connection trouble: every caller in the batch sees it
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc if isinstance(exc, Exception) else asyncio.CancelledError())
            if not isinstance(exc, Exception):
                raise
            return
        for (script, keys, args, future), reply in zip(batch, replies, strict=True):
            if isinstance(reply, NoScriptError):  # Redis restarted and forgot the script: load, run alone
                try:
                    reply = await script(keys=keys, args=args)
                except Exception as exc:
                    reply = exc
            if future.done():
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)
