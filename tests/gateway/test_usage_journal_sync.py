"""The usage journal's two syncers: a child process (the default) and the thread fallback answer
alike, on the event loop, once every file is synced, and report a file that cannot be; a child
process that cannot start, or is lost, hands its batches to the thread."""

from __future__ import annotations

import asyncio
import errno
import os
import random
import signal
import threading
from pathlib import Path

import pytest
from test_usage import make_record

from gateway.usage import journal_sync
from gateway.usage.config import UsageSettings
from gateway.usage.journal import UsageJournal, encode, read_segments, segments
from gateway.usage.journal_sync import ProcessSyncer, Syncer, ThreadSyncer

pytestmark = pytest.mark.anyio


def syncer_of(kind: str, loop: asyncio.AbstractEventLoop) -> Syncer:
    return ProcessSyncer(loop) if kind == "process" else ThreadSyncer(loop)


async def answer(syncer: Syncer, fds: tuple[int, ...]) -> tuple[BaseException | None, int]:
    """What ``done`` got, and the thread it ran on."""
    answered: asyncio.Future[tuple[BaseException | None, int]] = asyncio.get_running_loop().create_future()
    syncer.sync(fds, lambda error: answered.set_result((error, threading.get_ident())))
    return await asyncio.wait_for(answered, 30)


async def test_a_sync_answers_on_the_loop_once_every_file_is_synced(tmp_path: Path) -> None:
    for kind in ("process", "thread"):
        loop = asyncio.get_running_loop()
        syncer = syncer_of(kind, loop)
        fds = tuple(os.open(tmp_path / f"{kind}-{i}", os.O_WRONLY | os.O_CREAT) for i in range(3))
        try:
            for fd in fds:
                os.write(fd, b"usage\n")
            for _ in range(3):  # the same syncer, batch after batch
                assert await answer(syncer, fds) == (None, threading.get_ident())
        finally:
            syncer.stop()
            for fd in fds:
                os.close(fd)


async def test_a_file_that_cannot_be_synced_is_reported(tmp_path: Path) -> None:
    """A pipe has no fsync (EINVAL): the batch's waiters get the error, not a success."""
    for kind in ("process", "thread"):
        loop = asyncio.get_running_loop()
        syncer = syncer_of(kind, loop)
        read_end, write_end = os.pipe()
        good = os.open(tmp_path / kind, os.O_WRONLY | os.O_CREAT)
        try:
            error, _ = await answer(syncer, (good, write_end))
            assert isinstance(error, OSError) and error.errno == errno.EINVAL
            assert await answer(syncer, (good,)) == (None, threading.get_ident())
        finally:
            syncer.stop()
            for fd in (read_end, write_end, good):
                os.close(fd)


async def test_without_a_sync_process_the_journal_syncs_in_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(self: ProcessSyncer, loop: asyncio.AbstractEventLoop) -> None:
        raise OSError(errno.EAGAIN, "no process")

    monkeypatch.setattr(journal_sync.ProcessSyncer, "__init__", refuse)
    journal = UsageJournal(tmp_path, instance_id="thread", syncer="process")
    journal.open()
    rng = random.Random(16)
    records = [make_record(rng) for _ in range(5)]
    await asyncio.wait_for(asyncio.gather(*(journal.append(encode(r)) for r in records)), 60)
    assert isinstance(journal._syncer, ThreadSyncer)
    journal.close(done_seq=0)
    assert [r.request_id for r in read_segments(segments(tmp_path))] == [r.request_id for r in records]


def test_the_retired_aio_syncer_setting_means_the_thread(tmp_path: Path) -> None:
    """A deployment that still says ``TERN_USAGE_JOURNAL_SYNCER=aio`` starts, on the thread."""
    assert UsageSettings(spool_dir=tmp_path, journal_syncer="aio").journal_syncer == "thread"


async def test_the_thread_syncer_can_be_chosen(tmp_path: Path) -> None:
    """``TERN_USAGE_JOURNAL_SYNCER=thread``: to compare the two on one machine."""
    settings = UsageSettings(spool_dir=tmp_path, journal_syncer="thread")
    journal = UsageJournal(tmp_path, instance_id="chosen", syncer=settings.journal_syncer)
    journal.open()
    await asyncio.wait_for(journal.append(encode(make_record(random.Random(17)))), 60)
    assert isinstance(journal._syncer, ThreadSyncer)
    journal.close(done_seq=0)
    assert len(read_segments(segments(tmp_path))) == 1


async def test_the_journal_syncs_in_a_child_process_by_default(tmp_path: Path) -> None:
    assert UsageSettings(spool_dir=tmp_path).journal_syncer == "process"
    journal = UsageJournal(tmp_path, instance_id="default")
    journal.open()
    await asyncio.wait_for(journal.append(encode(make_record(random.Random(18)))), 60)
    assert isinstance(journal._syncer, ProcessSyncer)
    journal.close(done_seq=0)
    assert len(read_segments(segments(tmp_path))) == 1


async def test_a_lost_sync_process_hands_its_batches_to_the_process_itself(tmp_path: Path) -> None:
    """The child killed with a batch unanswered: that batch and the next are still synced and answered
    (by the kernel AIO syncer or the thread), none is lost or answered twice."""
    loop = asyncio.get_running_loop()
    syncer = ProcessSyncer(loop)
    fd = os.open(tmp_path / "segment", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"usage\n")
        assert await answer(syncer, (fd,)) == (None, threading.get_ident())
        os.kill(syncer._process.pid, signal.SIGSTOP)  # it takes the next batch and never answers
        answers: list[BaseException | None] = []
        unanswered: asyncio.Future[None] = loop.create_future()
        syncer.sync((fd,), lambda error: (answers.append(error), unanswered.set_result(None)))
        await asyncio.sleep(0.1)
        assert answers == []
        syncer._process.kill()
        await asyncio.wait_for(unanswered, 30)
        assert answers == [None]
        assert not isinstance(syncer._fallback, ProcessSyncer | None)
        assert await answer(syncer, (fd,)) == (None, threading.get_ident())
        assert answers == [None]
    finally:
        syncer.stop()
        os.close(fd)
