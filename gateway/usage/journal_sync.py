"""How the usage journal makes a written batch durable without blocking the event loop.

By default a small child process does the syncs (:class:`ProcessSyncer`): the gateway hands it the
batch's file descriptors over a Unix socket and the event loop watches for its answer. The
``fdatasync`` then runs wherever the scheduler finds a free core, and no thread of the gateway takes
the GIL from the event loop. Where the child cannot start (or once it died), a syncer thread
(:class:`ThreadSyncer`, the one fallback) does it: it takes the GIL from the loop twice a batch, which
cost a few percent of requests/s under load, and runs everywhere.

A third syncer, kernel AIO (``IOCB_CMD_FDSYNC`` through raw syscall numbers), was retired: the
measurements in docs/limits-and-billing.md put it level with the thread on the idle machine (0.923
against 0.944 of the parent's requests/s at bbd074d) and level with or under the child (0.958 against
0.965 at 4548832; the child served more in 45 of 66 loaded rounds), so it backed no claim the other
two do not, and it only ran on Linux x86_64/aarch64 with the thread behind it anyway.

Both give the same guarantee: ``done`` runs on the loop once every descriptor was ``fdatasync``-ed
(or with the error). A child process that cannot start or dies hands its unanswered batches, and
every later one, to the thread, which syncs them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from gateway.usage import journal_sync_worker as worker

log = logging.getLogger(__name__)

Done = Callable[[BaseException | None], None]
SyncerKind = Literal["process", "thread"]

sync_data = getattr(os, "fdatasync", os.fsync)
"""fdatasync: the data and the size of the file (what a reader needs), not its times."""


class Syncer(Protocol):
    loop: asyncio.AbstractEventLoop
    """Where ``done`` runs."""

    def sync(self, fds: tuple[int, ...], done: Done) -> None:
        """Sync ``fds``, then call ``done`` (with the error, if any) on the loop."""
        ...

    def stop(self) -> None: ...


def make_syncer(loop: asyncio.AbstractEventLoop, kind: SyncerKind = "process") -> Syncer:
    """The syncer ``kind`` names; where the child process cannot start, the thread."""
    if kind == "process":
        try:
            return ProcessSyncer(loop)
        except OSError as exc:
            log.info("usage journal syncs in a thread (no sync process: %s)", exc)
    return ThreadSyncer(loop)


class ThreadSyncer:
    """One long-lived thread that only syncs files: the lines were written from the event loop
    already, so its one job per batch is the wait for the disk, and its answer is one callback.
    (``asyncio.to_thread`` per batch cost a task, an executor work item and two GIL hand-offs.)"""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.jobs: queue.SimpleQueue[tuple[tuple[int, ...], Done] | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="usage-journal-sync", daemon=True).start()

    def sync(self, fds: tuple[int, ...], done: Done) -> None:
        self.jobs.put((fds, done))

    def stop(self) -> None:
        self.jobs.put(None)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            fds, done = job
            error: BaseException | None = None
            try:
                for fd in fds:
                    sync_data(fd)
            except OSError as exc:
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                self.loop.call_soon_threadsafe(done, error)


# ---------------------------------------------------------------- a child process

_WORKER = Path(worker.__file__)


@dataclass(slots=True)
class _Batch:
    fds: tuple[int, ...]
    done: Done
    messages: int = 0
    """Answers still to come: one a message of at most ``worker.MAX_FDS`` descriptors."""
    error: BaseException | None = None


class ProcessSyncer:
    """``fdatasync`` in a child process (``journal_sync_worker``): a message with the batch's
    descriptors out, one answer back, read when the socket wakes the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        channel, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", str(_WORKER), str(child_end.fileno())],
                pass_fds=(child_end.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            channel.close()
            raise
        finally:
            child_end.close()
        channel.setblocking(False)
        self.loop = loop
        self._channel = channel
        self._waiting: deque[_Batch] = deque()
        """Batches sent, oldest first: the child answers in order."""
        self._fallback: Syncer | None = None
        """Where batches go once the child is lost."""
        loop.add_reader(channel.fileno(), self._answered)

    def sync(self, fds: tuple[int, ...], done: Done) -> None:
        if self._fallback is not None:
            self._fallback.sync(fds, done)
            return
        batch = _Batch(fds, done)
        self._waiting.append(batch)
        try:
            for start in range(0, len(fds), worker.MAX_FDS):
                socket.send_fds(self._channel, [b"s"], list(fds[start : start + worker.MAX_FDS]))
                batch.messages += 1
        except OSError as exc:  # the child is gone (or not reading): the fallback syncs it all
            self._lose(exc)
            return
        if batch.messages == 0:  # nothing to sync
            self._waiting.remove(batch)
            self.loop.call_soon(done, None)

    def _answered(self) -> None:
        finished: list[_Batch] = []
        lost: BaseException | None = None
        while True:
            try:
                answer = self._channel.recv(worker.ANSWER.size)
            except BlockingIOError:
                break
            except OSError as exc:
                lost = exc
                break
            if not answer or not self._waiting:  # end of file: the child ended
                lost = ConnectionResetError("the usage journal's sync process ended")
                break
            (code,) = worker.ANSWER.unpack(answer)
            batch = self._waiting[0]
            if code and batch.error is None:
                batch.error = OSError(code, os.strerror(code))
            batch.messages -= 1
            if batch.messages == 0:
                finished.append(self._waiting.popleft())
        for batch in finished:
            try:
                batch.done(batch.error)
            except Exception:
                log.exception("usage journal sync callback failed")
        if lost is not None:
            self._lose(lost)

    def _lose(self, exc: BaseException) -> None:
        """The child cannot be reached: its unanswered batches, and all later ones, go to the
        thread (a second ``fdatasync`` of a synced file is harmless)."""
        log.error("usage journal sync process lost (%s): syncing in this process", exc)
        self._close_child()
        self._fallback = ThreadSyncer(self.loop)
        waiting, self._waiting = self._waiting, deque()
        for batch in waiting:
            self._fallback.sync(batch.fds, batch.done)

    def _close_child(self) -> None:
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            self.loop.remove_reader(self._channel.fileno())
        self._channel.close()  # the child reads end of file and exits
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # stuck in a sync of a failing disk
            self._process.kill()
            self._process.wait()

    def stop(self) -> None:
        """After the journal drained (nothing unanswered)."""
        if self._fallback is not None:
            self._fallback.stop()
            return
        self._close_child()
