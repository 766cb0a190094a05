"""A local append-only journal of usage, so a request's usage outlives a crash of the gateway.

Every usage record is appended here before it goes to the in-memory buffer that feeds Postgres.
Appends are group-committed: lines queue up while one ``write`` + ``fsync`` runs (in a thread, off
the event loop), and the next batch takes all of them at once. So one fsync serves every request
that completed during the previous one, and a request waits for at most about two fsyncs. The
proxy awaits that before the last bytes of an answer, so an answer a client saw complete is on disk.

Files are segments, one open per process at a time (named ``<start ns>-<instance>.journal``), each
locked with ``flock`` by its process while it lives: a lock that can be taken belongs to a dead
process, and its segment is replayed (:mod:`gateway.usage.recorder`) by whoever takes it. A
segment is deleted once it is closed and every record in it has reached Postgres (or the outage
spool). Replays are idempotent: rows are keyed by request id and start time.

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
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

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
    """The sequence number of the last record appended to it."""


def _open_locked(path: Path) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _write_all(fd: int, data: bytes, sync: bool) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    if sync:
        os.fsync(fd)


def encode(record: UsageRecord) -> bytes:
    """One line (orjson writes the dataclass itself, datetimes in ISO 8601, 20x faster than
    ``to_json``; ``UsageRecord.from_json`` reads it back)."""
    return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)


def encode_in_flight(record: UsageRecord) -> bytes:
    return orjson.dumps({"in_flight": record}, option=orjson.OPT_APPEND_NEWLINE)


class UsageJournal:
    def __init__(self, directory: Path, *, instance_id: str, sync: bool = True) -> None:
        self.directory = directory
        self.instance_id = instance_id
        self.sync = sync
        self.seq = 0
        """Records appended by this process so far (the last one's sequence number)."""
        self._segment: Segment | None = None
        self._closed: list[Segment] = []
        self._pending: list[bytes] = []
        self._pending_seq = 0
        self._waiter: asyncio.Future[None] | None = None
        self._writer: asyncio.Task[None] | None = None
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
        if self.disabled:
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        self._pending.append(line)
        if self._waiter is None:
            self._waiter = asyncio.get_running_loop().create_future()
        waiter = self._waiter
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_batches(), name="usage-journal")
        return waiter

    async def _write_batches(self) -> None:
        try:
            while self._pending:
                lines, waiter, last_seq = self._pending, self._waiter, self._pending_seq
                self._pending, self._waiter = [], None
                assert waiter is not None
                try:
                    segment = self._current()
                    data = b"".join(lines)
                    await asyncio.to_thread(_write_all, segment.fd, data, self.sync)
                    segment.size += len(data)
                    segment.last_seq = max(segment.last_seq, last_seq)
                except Exception as exc:  # a full disk: usage still reaches Postgres from the buffer
                    log.error("usage journal write failed: %s", exc)
                    if not waiter.done():
                        waiter.set_exception(exc)
                    waiter.exception()  # retrieved: a caller that did not wait is not warned about it
                    continue
                if not waiter.done():
                    waiter.set_result(None)
        finally:
            self._writer = None

    def write_now(self, line: bytes) -> None:
        """Write one line at once, on the event loop, without fsync: it survives the process dying
        the next moment (the kernel has it), not the machine. For in-flight snapshots, which a
        queued write could miss when the process dies while an fsync runs."""
        if self.disabled:
            return
        try:
            segment = self._current()
            _write_all(segment.fd, line, False)
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
        """Wait until every queued line is written."""
        while self._writer is not None:
            await asyncio.shield(self._writer)

    # ------------------------------------------------------------ retiring

    def retire(self, done_seq: int) -> None:
        """Delete closed segments whose records all reached Postgres or the spool (``<= done_seq``)."""
        keep = []
        for segment in self._closed:
            if segment.last_seq <= done_seq:
                _delete(segment)
            else:
                keep.append(segment)
        self._closed = keep

    def close(self, *, done_seq: int) -> None:
        """At shutdown: delete every segment whose records are all stored, release the rest."""
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


def segments(directory: Path) -> list[Path]:
    """Every segment, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob(f"*{SUFFIX}") if p.is_file())


def read_segments(paths: list[Path]) -> list[UsageRecord]:
    """The records dead processes' segments hold: each finished request once, and for a stream with
    only in-flight snapshots the last one (estimated). Read together, since a stream's snapshots and
    its finished record may lie in different segments. A torn last line (the process died while
    writing it) is skipped."""
    finished: dict[str, UsageRecord] = {}
    in_flight: dict[str, UsageRecord] = {}
    for path in paths:
        with open(path, "rb") as handle:
            for line in handle:
                try:
                    data: dict[str, Any] = orjson.loads(line)
                    snapshot = data.get("in_flight")
                    record = UsageRecord.from_json(snapshot if isinstance(snapshot, dict) else data)
                except (ValueError, TypeError, KeyError):
                    continue
                (in_flight if snapshot is not None else finished)[record.request_id] = record
    cut = [r for rid, r in in_flight.items() if rid not in finished]
    return [*finished.values(), *cut]
