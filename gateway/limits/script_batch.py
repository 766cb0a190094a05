"""Lua script calls made in the same event-loop turn go to Redis in one round trip.

Every request runs one admission script and one settlement script. Called one by one, each
costs a connection checkout, a write and a read of its own; under load most of a process's
Redis time is that overhead. Here a call only queues its script and arguments; a flush task
(started when the first call of a turn arrives) writes everything queued as one pipeline of
EVALSHAs (not a transaction), reads the replies in order and hands each caller its own, so 64
concurrent requests cost one round trip instead of 64. A lone request still costs one round
trip, and never waits for another batch to come back first. Each script stays atomic on its
own; batching only shares the connection and the network round trip.

Calls are RESP-encoded here, not by redis-py's ``pack_command`` (which encodes and checks every
argument one by one, the largest share of a call's CPU): the keys and limit arguments a request
shares with every other request of its key come as :class:`Packed` (encoded once per key and day),
so only the few per-request arguments are encoded per call, and budgets' extra keys and
arguments cost nothing per call to encode.

A batch is written and read on a connection of its own, taken from the client's pool the first
time and kept for the next batch: redis-py's pipeline object and pool checkout cost several times
the CPU of the write and read themselves (measured: about 200 against 85 us per lone call). A
kept connection that Redis closed meanwhile reconnects; one that failed during a batch is closed
and handed back to the pool.

That path goes through redis-py's connection internals (``pool.get_connection``,
``Connection.send_packed_command``, ``read_response``, ``can_read``), which are not its documented API
and change between versions (``get_connection`` used to require a command name), so
pyproject.toml pins redis-py to ``REDIS_PY_TESTED``, the versions this was tested on;
``tests/gateway/test_limits_script_batch.py`` fails on any other. Widen both after running that test
file and tests/gateway/test_limits*.py on the new version.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError

REDIS_PY_TESTED = ">=8.0.1,<8.2"
"""The redis-py versions the fast path was tested on: pyproject.toml's requirement, word for word."""
MAX_BATCH = 256
MAX_IDLE_CONNECTIONS = 4

Arg = int | str | bytes
Key = str | bytes


def _encode(value: Arg) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return b"%d" % value


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(value), value)


@dataclass(frozen=True, slots=True)
class Packed:
    """Keys or arguments many calls share, RESP-encoded once."""

    values: tuple[bytes, ...]
    data: bytes

    @classmethod
    def of(cls, values: Iterable[Arg]) -> Packed:
        encoded = tuple(_encode(v) for v in values)
        return cls(encoded, b"".join(_bulk(v) for v in encoded))


Keys = Sequence[Key] | Packed
Args = Sequence[Arg | Packed]
_Call = tuple[AsyncScript, Keys, Args, asyncio.Future[object]]


def _flat(values: Keys | Args) -> list[bytes]:
    """The values of a call's keys or arguments, Packed ones unpacked (for redis-py's own call)."""
    if isinstance(values, Packed):
        return list(values.values)
    flat: list[bytes] = []
    for value in values:
        if isinstance(value, Packed):
            flat += value.values
        else:
            flat.append(_encode(value))
    return flat


def pack_evalsha(sha: bytes, keys: Keys, args: Args) -> list[bytes]:
    """``EVALSHA sha numkeys keys... args...`` in RESP: the parts, to be written in order."""
    if isinstance(keys, Packed):
        n_keys, parts = len(keys.values), [keys.data]
    else:
        n_keys, parts = len(keys), [_bulk(_encode(k)) for k in keys]
    count = 3 + n_keys
    for arg in args:
        if isinstance(arg, Packed):
            count += len(arg.values)
            parts.append(arg.data)
        else:
            count += 1
            parts.append(_bulk(_encode(arg)))
    n = b"%d" % n_keys
    return [b"*%d\r\n$7\r\nEVALSHA\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n" % (count, len(sha), sha, len(n), n), *parts]


class ScriptBatcher:
    def __init__(self, redis: Redis, *, max_batch: int = MAX_BATCH) -> None:
        self.redis = redis
        self.max_batch = max_batch
        self._queue: list[_Call] = []
        self._flushes: set[asyncio.Task[None]] = set()
        self._flush_pending = False
        """A flush task has been started but has not taken the queue yet."""
        self._idle: list[Connection] = []
        """Connections of finished batches, for the next ones."""

    async def call(self, script: AsyncScript, *, keys: Keys, args: Args) -> object:
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
        pool = self.redis.connection_pool
        connection = self._idle.pop() if self._idle else None
        try:
            if connection is None:
                connection = await pool.get_connection()
            elif connection.is_connected and await connection.can_read():
                # Redis closed it while it sat idle (a restart, an idle timeout), or it holds stray
                # data: start afresh (send_packed_command connects) instead of failing the batch.
                await connection.disconnect()
            packed: list[bytes] = []
            for script, keys, args, _ in batch:
                packed += pack_evalsha(script.sha.encode(), keys, args)
            await connection.send_packed_command(b"".join(packed))
            replies: list[object] = []
            for _ in batch:
                try:
                    replies.append(await connection.read_response())
                except ResponseError as exc:  # this script's own error: the others' replies follow
                    replies.append(exc)
        except BaseException as exc:  # connection trouble: every caller in the batch sees it
            if connection is not None:
                with contextlib.suppress(Exception):
                    await connection.disconnect()
                await pool.release(connection)
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc if isinstance(exc, Exception) else asyncio.CancelledError())
            if not isinstance(exc, Exception):
                raise
            return
        if len(self._idle) < MAX_IDLE_CONNECTIONS:
            self._idle.append(connection)
        else:  # a burst of concurrent batches is over: give the extra connections back
            await pool.release(connection)
        for (script, keys, args, future), reply in zip(batch, replies, strict=True):
            if isinstance(reply, NoScriptError):  # Redis restarted and forgot the script: load, run alone
                try:
                    reply = await script(keys=_flat(keys), args=_flat(args))
                except Exception as exc:
                    reply = exc
            if future.done():
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)
