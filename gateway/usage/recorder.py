"""The usage buffer: ``record()`` is a synchronous append, a background task flushes batches.

- Every record is first appended to the local :class:`UsageJournal` (group-committed to disk);
  ``record()`` returns the future the proxy awaits before an answer's last bytes. At start, and
  every ``replay_interval_s``, the segments of dead processes (a SIGKILLed gateway) are replayed.
- A burst of requests becomes a few multi-row statements, not one transaction each.
- The journal is the only on-disk queue. When a flush fails (Postgres down), the batch goes back to
  the front of the buffer and the journal's watermark waits, so its segments stay on disk; the
  flush is retried every ``replay_interval_s``. Nothing is lost; replays never double count.
- ``stop()`` (the app's lifespan shutdown, so SIGTERM) flushes what is left; if Postgres is
  unreachable the rest stays in the journal's segments, released for the next start to replay.
- Every write goes through :meth:`UsageRecorder.store`: rows Postgres rejects for their content
  (not an outage) are quarantined one by one (``journal.quarantine``), the rest stored; the same
  path takes dead processes' segments, old spool files and the engines' ledgers (``ledger.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import date

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.metrics import USAGE_FLUSH_ERRORS, USAGE_QUARANTINED, USAGE_QUEUE
from gateway.usage.batch_writer import write_batch
from gateway.usage.config import UsageSettings
from gateway.usage.journal import (
    LEGACY_SUFFIX,
    UsageJournal,
    claim,
    encode,
    encode_in_flight,
    instance_of,
    quarantine,
    read_segments,
    segments,
)
from gateway.usage.partitions import maintain
from gateway.usage.schemas import UsageRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Recovered:
    """What a replay of dead gateway processes' journals (or their engines' ledgers) stored."""

    records: list[UsageRecord]
    """Every record replayed, whether or not Postgres had it already."""
    new: int
    """How many were new to Postgres."""
    instances: frozenset[str] = frozenset()
    """The dead processes (their instance ids)."""


RecoveryHook = Callable[[Recovered], Awaitable[None]]
"""Told of a replay (the limits free the dead processes' slots and resync budget counters)."""


class UsageRecorder:
    def __init__(
        self, *, engine: AsyncEngine, settings: UsageSettings, instance_id: str | None = None
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.journal = UsageJournal(
            settings.journal_path,
            instance_id=instance_id or uuid.uuid4().hex[:16],
            sync=settings.journal_fsync,
            commit_interval_s=settings.journal_commit_interval_ms / 1000,
            syncer=settings.journal_syncer,
        )
        self.on_recovered: list[RecoveryHook] = []
        self._done_seq = 0
        """Journal sequence number up to which records reached Postgres (the watermark)."""
        self._buffer: list[UsageRecord] = []
        self._wake = asyncio.Event()
        self._known_months: set[date] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._flush_lock = asyncio.Lock()
        self.postgres_ok = True
        self.flushed = 0
        """Records this process wrote to Postgres (new rows only)."""

    # ------------------------------------------------------------ the hot path

    def record(self, record: UsageRecord) -> asyncio.Future[None]:
        """Queue one request's usage. Never awaits, so a cancelled request's cleanup cannot skip it;
        the future is done once the record is in the journal on disk."""
        durable = self.journal.append(encode(record))
        self._buffer.append(record)
        USAGE_QUEUE.inc()
        if len(self._buffer) >= self.settings.batch_size:
            self._wake.set()
        return durable

    def snapshot(self, record: UsageRecord) -> None:
        """Journal what an unfinished stream has used so far (billed, estimated, if this process dies)."""
        self.journal.write_now(encode_in_flight(record))

    @property
    def pending(self) -> int:
        return len(self._buffer)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.run_maintenance()
        self.journal.open()
        try:
            await self.replay_journals()
        except Exception as exc:  # Postgres down at start: the replay loop tries again
            log.warning("usage journal replay failed: %s", exc)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._flush_loop(), name="usage-flush"),
            loop.create_task(self._replay_loop(), name="usage-replay"),
            loop.create_task(self._maintenance_loop(), name="usage-maintenance"),
        ]

    async def stop(self) -> None:
        """Drain: flush everything buffered, then stop the background tasks. If Postgres is down the
        rest stays in the journal: its segments are released, and the next start replays them."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.journal.drain()
        while self._buffer:
            if not await self.flush():  # Postgres is down: the rest stays on disk for the next start
                rest, self._buffer = self._buffer, []
                USAGE_QUEUE.dec(len(rest))
                if self.journal.disabled:  # nowhere on disk to keep them (said at start)
                    log.error("%d usage records lost: Postgres is down and the journal disabled", len(rest))
                else:
                    log.warning("%d usage records stay in the journal for the next start", len(rest))
        self.journal.close(done_seq=self._done_seq)

    # ------------------------------------------------------------ flushing

    async def flush(self) -> bool:
        """Write one batch. Returns False when Postgres failed: the batch waits at the front of the
        buffer, and its journal segments stay on disk (the watermark does not pass it)."""
        async with self._flush_lock:
            batch = self._buffer[: self.settings.batch_size]
            if not batch:
                return True
            del self._buffer[: len(batch)]
            USAGE_QUEUE.dec(len(batch))
            try:
                self.flushed += await self.store(batch)
            except BaseException as exc:  # cancelled (stop() drains it) or Postgres is down
                self._buffer[:0] = batch
                USAGE_QUEUE.inc(len(batch))
                if not isinstance(exc, Exception):
                    raise
                USAGE_FLUSH_ERRORS.inc()
                if self.postgres_ok:
                    log.warning("usage flush failed, kept in the journal until Postgres answers: %s", exc)
                self.postgres_ok = False
                return False
            self.postgres_ok = True
            self._stored(len(batch))
            return True

    async def store(self, records: list[UsageRecord]) -> int:
        """Write records to Postgres (idempotent); returns how many were new. Raises while Postgres
        is down. A batch Postgres rejects for its content is written again one record at a time,
        and the records it rejects are quarantined (logged and counted), so they hold nothing back."""
        try:
            return await write_batch(self.engine, records, known_months=self._known_months)
        except Exception as exc:
            await self._raise_if_outage(exc)
        new = 0
        for record in records:
            try:
                new += await write_batch(self.engine, [record], known_months=self._known_months)
            except Exception as exc:
                await self._raise_if_outage(exc)
                quarantine(self.journal.directory, [encode(record)], f"rejected by Postgres: {exc}")
                USAGE_QUARANTINED.inc()
        return new

    async def _raise_if_outage(self, exc: Exception) -> None:
        self._known_months.clear()  # a partition may have been dropped meanwhile
        if _is_outage(exc) or not await self._postgres_reachable():
            raise exc

    def _stored(self, records: int) -> None:
        """The oldest ``records`` of the journal reached Postgres."""
        self._done_seq += records
        self.journal.retire(self._done_seq)

    async def _flush_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.flush_interval_s)
            self._wake.clear()
            while self._buffer:
                if not await self.flush():  # Postgres is down: try again a little later
                    await asyncio.sleep(self.settings.replay_interval_s)
                    break
                if len(self._buffer) < self.settings.batch_size:
                    break

    # ------------------------------------------------------------ replay

    async def _replay_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.replay_interval_s)
            try:
                await self.replay_journals()
            except Exception:
                log.exception("usage replay failed")

    async def replay_journals(self) -> int:
        """Store what dead processes journaled (idempotent); returns the records new to Postgres.

        Every segment no live process holds is read together (a stream's snapshots and its
        finished record may lie in different ones), written, then deleted; so are the batches a
        gateway before the one queue spooled (``*.jsonl`` in the old spool directory, replayed once
        on upgrade). Raises when Postgres is down: the files stay for the next try."""
        legacy = segments(self.settings.legacy_spool_dir, LEGACY_SUFFIX)
        with contextlib.ExitStack() as claims:
            paths = [
                path
                for path in [*segments(self.journal.directory), *legacy]
                if not self.journal.owns(path) and claims.enter_context(claim(path))
            ]
            if not paths:
                return 0
            unreadable: list[bytes] = []
            records = read_segments(paths, unreadable)
            new = 0
            for start in range(0, len(records), self.settings.batch_size):
                new += await self.store(records[start : start + self.settings.batch_size])
            if unreadable:
                quarantine(self.journal.directory, unreadable, "unreadable")
                USAGE_QUARANTINED.inc(len(unreadable))
            for path in paths:
                path.unlink(missing_ok=True)
        self.flushed += new
        log.warning(
            "replayed the usage journal of a gateway that died: %d records, %d new", len(records), new
        )
        dead = frozenset(instance_of(p) for p in paths if p not in legacy)
        await self.recovered(Recovered(records, new, dead))
        return new

    async def recovered(self, recovered: Recovered) -> None:
        for hook in self.on_recovered:
            try:
                await hook(recovered)
            except Exception:
                log.exception("usage recovery hook %r failed", hook)

    async def _postgres_reachable(self) -> bool:
        try:
            async with self.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
            return True
        except Exception:
            return False

    # ------------------------------------------------------------ partitions

    async def run_maintenance(self) -> list[str]:
        try:
            async with self.engine.begin() as conn:
                return await maintain(
                    conn,
                    ahead=self.settings.partitions_ahead,
                    retention_months=self.settings.retention_months,
                )
        except Exception as exc:  # Postgres down at start: flushes create partitions when it returns
            log.warning("usage partition maintenance failed: %s", exc)
            return []

    async def _maintenance_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.maintenance_interval_s)
            await self.run_maintenance()


def _is_outage(exc: BaseException) -> bool:
    if isinstance(exc, OperationalError | InterfaceError | OSError | ConnectionError):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated
