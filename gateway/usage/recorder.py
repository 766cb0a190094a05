"""The usage buffer: ``record()`` is a synchronous append, a background task flushes batches.

- A burst of requests becomes a few multi-row statements, not one transaction each.
- When a flush fails (Postgres down), the batch goes to the on-disk :class:`Spool` and is replayed
  once Postgres answers again. Nothing is lost; replays never double count (see service.py).
- ``stop()`` (the app's lifespan shutdown, so SIGTERM) flushes what is left, spooling it if
  Postgres is unreachable, so the next start replays it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import date

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.metrics import USAGE_FLUSH_ERRORS, USAGE_QUEUE
from gateway.usage.config import UsageSettings
from gateway.usage.partitions import maintain
from gateway.usage.schemas import UsageRecord
from gateway.usage.service import write_batch
from gateway.usage.spool import Spool

log = logging.getLogger(__name__)


class UsageRecorder:
    def __init__(self, *, engine: AsyncEngine, settings: UsageSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.spool = Spool(settings.spool_dir)
        self._buffer: list[UsageRecord] = []
        self._wake = asyncio.Event()
        self._known_months: set[date] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._flush_lock = asyncio.Lock()
        self.postgres_ok = True
        self.flushed = 0
        """Records this process wrote to Postgres (new rows only)."""

    # ------------------------------------------------------------ the hot path

    def record(self, record: UsageRecord) -> None:
        """Queue one request's usage. Never awaits, so a cancelled request's cleanup cannot skip it."""
        self._buffer.append(record)
        USAGE_QUEUE.inc()
        if len(self._buffer) >= self.settings.batch_size:
            self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._buffer)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.run_maintenance()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._flush_loop(), name="usage-flush"),
            loop.create_task(self._replay_loop(), name="usage-replay"),
            loop.create_task(self._maintenance_loop(), name="usage-maintenance"),
        ]

    async def stop(self) -> None:
        """Drain: flush everything buffered (or spool it), then stop the background tasks."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        while self._buffer:
            if not await self.flush():  # Postgres is down: keep the rest on disk for the next start
                rest, self._buffer = self._buffer, []
                USAGE_QUEUE.dec(len(rest))
                self.spool.write(rest)
        await self.replay()

    # ------------------------------------------------------------ flushing

    async def flush(self) -> bool:
        """Write one batch. Returns False when Postgres failed and the batch went to the spool."""
        async with self._flush_lock:
            batch = self._buffer[: self.settings.batch_size]
            if not batch:
                return True
            del self._buffer[: len(batch)]
            USAGE_QUEUE.dec(len(batch))
            try:
                self.flushed += await write_batch(self.engine, batch, known_months=self._known_months)
            except Exception as exc:
                USAGE_FLUSH_ERRORS.inc()
                self._known_months.clear()  # a partition may have been dropped meanwhile
                path = self.spool.write(batch)
                if self.postgres_ok:
                    log.warning("usage flush failed, spooling to %s: %s", path, exc)
                self.postgres_ok = False
                return False
            return True

    async def _flush_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.flush_interval_s)
            self._wake.clear()
            while self._buffer:
                ok = await self.flush()
                if not ok or len(self._buffer) < self.settings.batch_size:
                    break

    # ------------------------------------------------------------ replay

    async def replay(self) -> int:
        """Replay spooled batches, oldest first; stops at the first outage. Returns batches replayed."""
        replayed = 0
        for path in self.spool.files():
            try:
                records = self.spool.read(path)
            except (OSError, ValueError) as exc:
                log.error("unreadable usage spool file %s moved aside: %s", path, exc)
                self.spool.quarantine(path)
                continue
            try:
                self.flushed += await write_batch(self.engine, records, known_months=self._known_months)
            except Exception as exc:
                self._known_months.clear()
                if await self._postgres_reachable() and not _is_outage(exc):
                    log.error("usage spool file %s rejected by Postgres, moved aside: %s", path, exc)
                    self.spool.quarantine(path)
                    continue
                self.postgres_ok = False
                return replayed
            self.spool.remove(path)
            replayed += 1
        if replayed:
            log.info("replayed %d spooled usage batches", replayed)
        self.postgres_ok = True
        return replayed

    async def _replay_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.replay_interval_s)
            try:
                await self.replay()
            except Exception:
                log.exception("usage replay failed")

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
