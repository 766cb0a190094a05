"""A local append-only journal of usage, so a request's usage outlives a crash of the gateway.

Every usage record is appended here before it goes to the in-memory buffer that feeds Postgres.
Appends are group-committed: the lines of one event loop turn are written together (one ``write``,
on the loop: the page cache takes it in microseconds), then they are synced (``fdatasync``, off the
loop: a child process or a thread, :mod:`gateway.usage.journal_sync`) while the next lines queue up; the
next batch takes all of them at once, and under load no sooner than ``commit_interval_s`` after the
previous sync began. So one sync serves every request that completed meanwhile, one future per
batch is shared by all its requests, and a request waits for at most about two syncs (plus the
interval under load). The proxy awaits that before the last bytes of an answer, so an answer a
client saw complete is on disk.

Files are segments, one open per process at a time (named ``<start ns>-<instance>.journal``), each
locked with ``flock`` by its process while it lives: a lock that can be taken belongs to a dead
process, and its segment is replayed (:mod:`gateway.usage.recorder`) by whoever takes it. A
segment is deleted once it is closed and every record in it has reached Postgres: while Postgres is
down the segments stay, and a process stopped during an outage leaves them for the next one to
replay. This is the only on-disk queue of usage. Replays are idempotent: rows are keyed by request id
and start time. Records Postgres rejects for their content (not an outage) are moved to
``rejected/`` (:func:`quarantine`), so they hold nothing else back.

Besides finished records the journal holds in-flight snapshots (``{"in_flight": record}``) of
streams whose upstream keeps no usage ledger; a snapshot without a finished record is what a dead
process last saw of that stream, billed as estimated.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from gateway.metrics import JOURNAL_SYNCED_RECORDS, JOURNAL_SYNCS
from gateway.usage.journal_sync import Syncer, SyncerKind, make_syncer
from gateway.usage.schemas import UsageRecord

log = logging.getLogger(__name__)

SUFFIX = ".journal"
SEGMENT_BYTES = 8 << 20
"""A segment is closed after this many bytes (or SEGMENT_AGE_S), so finished ones can be deleted."""
SEGMENT_AGE_S = 30.0


@dataclass(slots=True, eq=False)
class Segment:
    path: Path
    fd: int
    opened_at: float
    size: int = 0
    last_seq: int = 0
    """The sequence number of the last record written to it."""


def _open_locked(path: Path) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def encode(record: UsageRecord) -> bytes:
    """One line: the one encoding of a usage record on disk (orjson writes the dataclass itself, every
    field, datetimes in ISO 8601, 20x faster than ``to_json``; ``UsageRecord.from_json`` reads it
    back, and reads the lines of the retired spool too)."""
    return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)


def encode_in_flight(record: UsageRecord) -> bytes:
    return orjson.dumps({"in_flight": record}, option=orjson.OPT_APPEND_NEWLINE)


class UsageJournal:
    def __init__(
        self,
        directory: Path,
        *,
        instance_id: str,
        sync: bool = True,
        commit_interval_s: float = 0.0,
        syncer: SyncerKind = "process",
    ) -> None:
        self.directory = directory
        self.instance_id = instance_id
        self.sync = sync
        self.seq = 0
        """Records appended by this process so far (the last one's sequence number)."""
        self._segment: Segment | None = None
        self._closed: list[Segment] = []
        self._pending: list[bytes] = []
        """Lines not written yet: they are written together, once per event loop turn."""
        self._pending_seq = 0
        self._waiter: asyncio.Future[None] | None = None
        """Done once the pending lines are on disk (one future that all their requests share)."""
        self._syncing: asyncio.Future[None] | None = None
        """The batch whose sync runs now: the next one waits for it (one sync at a time)."""
        self._syncing_fds: tuple[int, ...] = ()
        self._written: list[Segment] = []
        """Segments written since the last sync began: the next one syncs them."""
        self._syncer: Syncer | None = None
        self.syncer_kind = syncer
        self.commit_interval_s = commit_interval_s
        self._last_sync_at = -math.inf
        self._last_batch = 0
        """Lines the last sync served."""
        self.disabled = False
        """The directory could not be written at start: usage goes to Postgres unjournaled."""

    # ------------------------------------------------------------ appending

    def append(self, line: bytes, *, counts: bool = True) -> asyncio.Future[None]:
        """Queue one line; the future is done once it is on disk. Never awaits.

        ``counts``: a finished record (flushed to Postgres later, so it keeps its segment alive)
        rather than an in-flight snapshot."""
        if counts:
            self.seq += 1
            self._pending_seq = self.seq
        waiter = self._waiter
        if waiter is None:
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            if self.disabled:
                self._waiter = None
                waiter.set_result(None)
                return waiter
            if self._syncing is None:  # else the running sync starts this batch when it ends
                self._schedule_batch(loop)
        self._pending.append(line)
        return waiter

    def _write_batch(self) -> None:
        """Write the pending lines (on the loop: a write to the page cache takes microseconds),
        then have the syncer make them durable; their waiter is done when it has."""
        lines, waiter, last_seq = self._pending, self._waiter, self._pending_seq
        self._pending, self._waiter = [], None
        if waiter is None:
            return
        try:
            segment = self._current()
            data = b"".join(lines)
            _write_all(segment.fd, data)
            segment.size += len(data)
            segment.last_seq = max(segment.last_seq, last_seq)
        except Exception as exc:  # a full disk: usage still reaches Postgres from the buffer
            self._fail(waiter, exc)
            return
        if not self.sync:  # the kernel has the lines: they outlive this process, not the machine
            waiter.set_result(None)
            return
        if segment not in self._written:
            self._written.append(segment)
        loop = asyncio.get_running_loop()
        if self._syncer is not None and self._syncer.loop is not loop:  # tests run several loops
            self._syncer.stop()
            self._syncer = None
        if self._syncer is None:
            self._syncer = make_syncer(loop, self.syncer_kind)
        self._last_sync_at = loop.time()
        self._last_batch = len(lines)
        JOURNAL_SYNCS.inc()
        JOURNAL_SYNCED_RECORDS.inc(len(lines))
        self._syncing = waiter
        self._syncing_fds = tuple(s.fd for s in self._written)
        self._written = []
        self._syncer.sync(self._syncing_fds, self._synced)

    def _synced(self, error: BaseException | None) -> None:
        waiter, self._syncing, self._syncing_fds = self._syncing, None, ()
        if waiter is not None:
            if error is not None:
                self._fail(waiter, error)
            elif not waiter.done():
                waiter.set_result(None)
        self._next_batch()

    def _next_batch(self) -> None:
        if self._waiter is not None and self._syncing is None:
            self._schedule_batch(asyncio.get_running_loop())

    def _schedule_batch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Write the next batch this loop turn or, when the last sync served more than one line
        (requests are arriving together), once ``commit_interval_s`` has passed since it began:
        under load syncs are spaced out and each serves more requests (a sync costs about 0.1 ms
        of CPU, a tenth of the requests/s at the bench's rate if it served one request each),
        while one client alone never waits for the interval."""
        delay = self._last_sync_at + self.commit_interval_s - loop.time()
        if delay > 0 and self._last_batch > 1:
            loop.call_later(delay, self._write_batch)
        else:
            loop.call_soon(self._write_batch)

    @staticmethod
    def _fail(waiter: asyncio.Future[None], exc: BaseException) -> None:
        log.error("usage journal write failed: %s", exc)
        if not waiter.done():
            waiter.set_exception(exc)
        waiter.exception()  # retrieved: a caller that did not wait is not warned about it

    def write_now(self, line: bytes) -> None:
        """Write one line at once, on the event loop, without fsync: it survives the process dying
        the next moment (the kernel has it), not the machine. For in-flight snapshots, which a
        queued write could miss when the process dies while an fsync runs."""
        if self.disabled:
            return
        try:
            segment = self._current()
            _write_all(segment.fd, line)
            segment.size += len(line)
        except OSError as exc:
            log.error("usage journal write failed: %s", exc)

    def _current(self) -> Segment:
        segment = self._segment
        if segment is not None and (
            segment.size >= SEGMENT_BYTES or time.monotonic() - segment.opened_at >= SEGMENT_AGE_S
        ):
            self._closed.append(segment)
            segment = None
        if segment is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / f"{time.time_ns():020d}-{self.instance_id}{SUFFIX}"
            segment = self._segment = Segment(path, _open_locked(path), time.monotonic())
        return segment

    def open(self) -> None:
        """Start the first segment now: its lock tells a successor this process existed. A directory
        that cannot be written disables the journal (said once) rather than the gateway."""
        try:
            self._current()
        except OSError as exc:
            log.error("usage journal disabled, %s cannot be written: %s", self.directory, exc)
            self.disabled = True

    async def drain(self) -> None:
        """Wait until every queued line is written (and synced)."""
        while (waiter := self._syncing or self._waiter) is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(waiter)

    # ------------------------------------------------------------ retiring

    def retire(self, done_seq: int) -> None:
        """Delete closed segments whose records all reached Postgres (``<= done_seq``)."""
        keep = []
        for segment in self._closed:
            if segment.last_seq <= done_seq and not self._unsynced(segment):
                _delete(segment)
            else:
                keep.append(segment)
        self._closed = keep

    def _unsynced(self, segment: Segment) -> bool:
        """Written and not synced yet: its descriptor stays open for the syncer."""
        return segment in self._written or segment.fd in self._syncing_fds

    def close(self, *, done_seq: int) -> None:
        """At shutdown (after :meth:`drain`): delete every segment whose records are all stored,
        release the rest (their locks go with their descriptors): the next process replays them."""
        if self._syncer is not None:
            self._syncer.stop()
            self._syncer = None
        self._written = []
        if self._segment is not None:
            self._closed.append(self._segment)
            self._segment = None
        self.retire(done_seq)
        for segment in self._closed:
            os.close(segment.fd)
        self._closed = []

    def owns(self, path: Path) -> bool:
        return any(s.path == path for s in (self._segment, *self._closed) if s is not None)


def _delete(segment: Segment) -> None:
    segment.path.unlink(missing_ok=True)
    os.close(segment.fd)


# ---------------------------------------------------------------- reading a dead process's segments


@contextlib.contextmanager
def claim(path: Path) -> Iterator[bool]:
    """Lock a segment for replay: False (and nothing to do) while its writer lives or another
    process replays it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            yield False
            return
        yield path.exists()  # it may have been replayed and deleted before we took the lock
    finally:
        os.close(fd)


def instance_of(path: Path) -> str:
    """The gateway process that wrote a segment."""
    return path.name.removesuffix(SUFFIX).split("-", 1)[-1]


LEGACY_SUFFIX = ".jsonl"
"""Batches the retired outage spool wrote (one JSON-lines file each): replayed once, like segments."""


def segments(directory: Path, suffix: str = SUFFIX) -> list[Path]:
    """Every segment (or, with ``LEGACY_SUFFIX``, every old spool file), oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob(f"*{suffix}") if p.is_file())


def read_segments(paths: list[Path], unreadable: list[bytes] | None = None) -> list[UsageRecord]:
    """The records dead processes' segments hold: each finished request once, and for a stream with
    only in-flight snapshots the last one (estimated). Read together, since a stream's snapshots and
    its finished record may lie in different segments. A torn last line (the process died while
    writing it) is skipped; any other line that does not read goes to ``unreadable``."""
    finished: dict[str, UsageRecord] = {}
    in_flight: dict[str, UsageRecord] = {}
    for path in paths:
        lines = path.read_bytes().splitlines(keepends=True)
        for number, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                data: dict[str, Any] = orjson.loads(line)
                snapshot = data.get("in_flight")
                record = UsageRecord.from_json(snapshot if isinstance(snapshot, dict) else data)
            except (ValueError, TypeError, KeyError, AttributeError):
                if unreadable is not None and line.endswith(b"\n") and number < len(lines) - 1:
                    unreadable.append(line)
                continue
            (in_flight if snapshot is not None else finished)[record.request_id] = record
    cut = [r for rid, r in in_flight.items() if rid not in finished]
    return [*finished.values(), *cut]


def quarantine(directory: Path, lines: list[bytes], reason: str) -> Path:
    """Set lines Postgres rejects (or that do not read) aside in ``rejected/`` for an operator, out
    of every replay: fsynced before the segments they came from are deleted."""
    target = directory / "rejected" / f"{time.time_ns():020d}-{os.getpid()}{SUFFIX}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "ab") as handle:
        handle.write(b"".join(lines))
        handle.flush()
        os.fsync(handle.fileno())
    log.error("%d usage lines moved aside to %s: %s", len(lines), target, reason)
    return target
