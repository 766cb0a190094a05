"""How the usage journal makes a written batch durable without blocking the event loop.

On Linux the sync is a kernel AIO ``IOCB_CMD_FDSYNC`` (Linux 4.18+): ``io_submit`` queues the
``fdatasync`` on the kernel's workqueue and returns at once; its completion is counted on an
eventfd that the event loop watches, so no Python thread takes part. A syncer thread (the fallback,
used where AIO is missing: another OS or architecture, a sandbox that refuses ``io_setup``) has
to take the GIL from the event loop twice a batch (to start the sync and to answer), and under load
each hand-off waits on the loop's thread; that cost the gateway several percent of its requests/s
at concurrency 64.

Both give the same guarantee: ``done`` runs on the loop once every descriptor was ``fdatasync``-ed
(or with the error).
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
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

log = logging.getLogger(__name__)

Done = Callable[[BaseException | None], None]
SyncerKind = Literal["aio", "thread"]

sync_data = getattr(os, "fdatasync", os.fsync)
"""fdatasync: the data and the size of the file (what a reader needs), not its times."""


class Syncer(Protocol):
    loop: asyncio.AbstractEventLoop
    """Where ``done`` runs."""

    def sync(self, fds: tuple[int, ...], done: Done) -> None:
        """Sync ``fds``, then call ``done`` (with the error, if any) on the loop."""
        ...

    def stop(self) -> None: ...


def make_syncer(loop: asyncio.AbstractEventLoop, kind: SyncerKind = "aio") -> Syncer:
    """The kernel AIO syncer where the kernel offers it (and ``kind`` is ``aio``), else the thread."""
    if kind == "thread":
        return ThreadSyncer(loop)
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
