"""How the usage journal makes a written batch durable without blocking the event loop.

By default a small child process does the syncs (:class:`ProcessSyncer`): the gateway hands it the
batch's file descriptors over a Unix socket and the event loop watches for its answer. The
``fdatasync`` then runs wherever the scheduler finds a free core, and no thread of the gateway takes
the GIL from the event loop. Kernel AIO (below) queues the sync on a kernel worker bound to the
submitting CPU, i.e. the event loop's own: under load the loop and that worker take turns on one
core, so each sync waited several milliseconds for the loop's time slice (measured: 4.6 ms against
0.6 ms in a child process, beside a busy loop), and the closed-loop client waits with it.

The kernel AIO syncer submits an ``IOCB_CMD_FDSYNC`` (Linux 4.18+): ``io_submit`` queues the
``fdatasync`` on the kernel's workqueue and returns at once; its completion is counted on an
eventfd that the event loop watches, so no Python thread takes part. A syncer thread (the fallback,
used where AIO is missing: another OS or architecture, a sandbox that refuses ``io_setup``) has
to take the GIL from the event loop twice a batch (to start the sync and to answer), and under load
each hand-off waits on the loop's thread; that cost the gateway several percent of its requests/s
at concurrency 64.

All give the same guarantee: ``done`` runs on the loop once every descriptor was ``fdatasync``-ed
(or with the error). A child process that cannot start or dies hands its unanswered batches, and
every later one, to the kernel AIO syncer (or the thread), which syncs them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import platform
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
SyncerKind = Literal["process", "aio", "thread"]

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
    """The syncer ``kind`` names; where it cannot start, the next of process, kernel AIO, thread."""
    if kind == "thread":
        return ThreadSyncer(loop)
    if kind == "process":
        try:
            return ProcessSyncer(loop)
        except OSError as exc:
            log.info("usage journal syncs in this process (no sync process: %s)", exc)
    try:
        return AioSyncer(loop)
    except (OSError, AttributeError) as exc:
        log.info("usage journal syncs in a thread (kernel AIO unavailable: %s)", exc)
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


# ---------------------------------------------------------------- Linux kernel AIO

_IOCB_CMD_FDSYNC = 3
_IOCB_FLAG_RESFD = 1
_SYSCALLS = {  # io_setup, io_destroy, io_submit, io_getevents
    "x86_64": (206, 207, 209, 208),
    "aarch64": (0, 1, 2, 4),
}
_MAX_EVENTS = 64


class _Iocb(ctypes.Structure):
    """``struct iocb`` (linux/aio_abi.h), little-endian layout."""

    _fields_ = [
        ("aio_data", ctypes.c_uint64),
        ("aio_key", ctypes.c_uint32),
        ("aio_rw_flags", ctypes.c_int32),
        ("aio_lio_opcode", ctypes.c_uint16),
        ("aio_reqprio", ctypes.c_int16),
        ("aio_fildes", ctypes.c_uint32),
        ("aio_buf", ctypes.c_uint64),
        ("aio_nbytes", ctypes.c_uint64),
        ("aio_offset", ctypes.c_int64),
        ("aio_reserved2", ctypes.c_uint64),
        ("aio_flags", ctypes.c_uint32),
        ("aio_resfd", ctypes.c_uint32),
    ]


class _IoEvent(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_uint64),
        ("obj", ctypes.c_uint64),
        ("res", ctypes.c_int64),
        ("res2", ctypes.c_int64),
    ]


@dataclass(slots=True)
class _Job:
    done: Done
    outstanding: int = 0
    error: BaseException | None = None


class AioSyncer:
    """``fdatasync`` through kernel AIO, completions read when the eventfd wakes the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        numbers = _SYSCALLS.get(platform.machine())
        if not sys.platform.startswith("linux") or numbers is None or sys.byteorder != "little":
            raise OSError(errno.ENOSYS, f"no kernel AIO on {sys.platform} {platform.machine()}")
        self._setup, self._destroy, self._submit, self._getevents = numbers
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long
        self._ctx = ctypes.c_ulong(0)
        self._check(self._libc.syscall(self._setup, _MAX_EVENTS, ctypes.byref(self._ctx)))
        self._eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.loop = loop
        self._events = (_IoEvent * _MAX_EVENTS)()
        self._next_id = 0
        self._jobs: dict[int, _Job] = {}
        loop.add_reader(self._eventfd, self._completed)

    def _check(self, result: int) -> int:
        if result < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        return result

    def sync(self, fds: tuple[int, ...], done: Done) -> None:
        job_id = self._next_id = self._next_id + 1
        job = self._jobs[job_id] = _Job(done)
        for fd in fds:
            iocb = _Iocb(
                aio_data=job_id,
                aio_lio_opcode=_IOCB_CMD_FDSYNC,
                aio_fildes=fd,
                aio_flags=_IOCB_FLAG_RESFD,
                aio_resfd=self._eventfd,
            )
            pointers = (ctypes.POINTER(_Iocb) * 1)(ctypes.pointer(iocb))
            if self._libc.syscall(self._submit, self._ctx, 1, pointers) == 1:  # the kernel copied it
                job.outstanding += 1
                continue
            try:  # not queued (EAGAIN: the context is full): sync here, the guarantee comes first
                sync_data(fd)
            except OSError as exc:
                job.error = job.error or exc
        if job.outstanding == 0:
            del self._jobs[job_id]
            self.loop.call_soon(done, job.error)

    def _completed(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._eventfd)
        finished: list[_Job] = []
        count = _MAX_EVENTS
        while count == _MAX_EVENTS:
            count = self._libc.syscall(self._getevents, self._ctx, 0, _MAX_EVENTS, self._events, None)
            if count < 0:
                if ctypes.get_errno() == errno.EINTR:
                    count = _MAX_EVENTS
                continue
            for event in self._events[:count]:
                job = self._jobs.get(event.data)
                if job is None:
                    continue
                if event.res < 0:
                    job.error = job.error or OSError(-event.res, os.strerror(-event.res))
                job.outstanding -= 1
                if job.outstanding == 0:
                    del self._jobs[event.data]
                    finished.append(job)
        for job in finished:  # after every event is taken: a failing callback loses none of them
            try:
                job.done(job.error)
            except Exception:
                log.exception("usage journal sync callback failed")

    def stop(self) -> None:
        """After the journal drained: nothing is in flight (``io_destroy`` would wait for it)."""
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            self.loop.remove_reader(self._eventfd)
        self._libc.syscall(self._destroy, self._ctx)
        os.close(self._eventfd)


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
        in-process syncer (a second ``fdatasync`` of a synced file is harmless)."""
        log.error("usage journal sync process lost (%s): syncing in this process", exc)
        self._close_child()
        self._fallback = make_syncer(self.loop, "aio")
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
