"""The usage journal: what a SIGKILLed process had journaled is stored by the next one, exactly once.

A real child process records usage (its buffer never flushes on its own) and is SIGKILLed once the
journal says the records are on disk; a successor replays them into real PostgreSQL. In-flight
snapshots of a stream become an estimated row only when the stream has no finished record.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import pool, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from test_usage import count_rows, make_record, raw_and_rollup_sums

from gateway.metrics import JOURNAL_SYNCS
from gateway.usage.config import UsageSettings
from gateway.usage.journal import UsageJournal, encode, encode_in_flight, read_segments, segments
from gateway.usage.recorder import UsageRecorder
from gateway.usage.schemas import UsageRecord

pytestmark = pytest.mark.anyio

CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    from sqlalchemy.ext.asyncio import create_async_engine
    from gateway.usage.config import UsageSettings
    from gateway.usage.recorder import UsageRecorder
    from gateway.usage.schemas import UsageRecord

    async def main():
        settings = UsageSettings(flush_interval_s=3600, spool_dir=Path(sys.argv[2]))
        recorder = UsageRecorder(engine=create_async_engine(sys.argv[1]), settings=settings)
        await recorder.start()
        records = [UsageRecord.from_json(json.loads(line)) for line in sys.stdin]
        waits = [recorder.record(r) for r in records]
        await asyncio.gather(*waits)
        print("durable", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(database_url, poolclass=pool.NullPool)
    yield engine
    await engine.dispose()


def run_and_kill(database_url: str, spool: Path, records: list[UsageRecord]) -> None:
    """A child journals ``records`` and is SIGKILLed once they are on disk (none reached Postgres)."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, database_url, str(spool)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(b"".join(encode(r) for r in records))
    child.stdin.close()
    assert child.stdout.readline() == b"durable\n"
    child.send_signal(signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL


async def test_a_killed_process_journal_is_replayed_once_by_its_successor(
    db: AsyncEngine, database_url: str, tmp_path: Path
) -> None:
    rng = random.Random(11)
    records = [make_record(rng) for _ in range(120)]
    spool = tmp_path / "spool"
    run_and_kill(database_url, spool, records)
    assert await count_rows(db) == 0  # nothing was flushed: only the journal has them
    [segment] = segments(spool / "journal")
    torn = encode(make_record(rng))[:40]  # the process died in the middle of a line
    segment.write_bytes(segment.read_bytes() + torn)

    successor = UsageRecorder(engine=db, settings=UsageSettings(flush_interval_s=3600, spool_dir=spool))
    await successor.start()  # replays before serving
    try:
        assert await count_rows(db) == 120
        assert segment not in segments(spool / "journal")
        assert await successor.replay_journals() == 0
    finally:
        await successor.stop()
    raw, rollups = await raw_and_rollup_sums(db)
    assert rollups == raw and sum(v[4] for v in raw.values()) == sum(r.completion_tokens for r in records)


async def test_a_stream_cut_by_the_crash_is_billed_from_its_last_snapshot(
    db: AsyncEngine, tmp_path: Path
) -> None:
    rng = random.Random(12)
    finished, cut = make_record(rng), make_record(rng)
    journal = tmp_path / "spool" / "journal"
    journal.mkdir(parents=True)
    snapshots = [
        encode_in_flight(replace(finished, completion_tokens=3, usage_estimated=True)),
        encode_in_flight(replace(cut, completion_tokens=2, usage_estimated=True)),
        encode_in_flight(replace(cut, completion_tokens=5, usage_estimated=True)),
    ]
    # Two segments of one dead process: the finished record lies in the later one.
    (journal / f"{1:020d}-1.journal").write_bytes(b"".join(snapshots))
    (journal / f"{2:020d}-1.journal").write_bytes(encode(finished))

    recorder = UsageRecorder(engine=db, settings=UsageSettings(spool_dir=tmp_path / "spool"))
    assert await recorder.replay_journals() == 2
    async with db.connect() as conn:
        rows = {
            r.request_id: (r.completion_tokens, r.usage_estimated)
            for r in await conn.execute(text("SELECT * FROM usage_records"))
        }
    assert rows == {finished.request_id: (finished.completion_tokens, False), cut.request_id: (5, True)}


async def test_an_unwritable_journal_directory_disables_the_journal_not_the_gateway(
    db: AsyncEngine, tmp_path: Path
) -> None:
    (tmp_path / "spool").write_text("a file where the spool directory should be")
    recorder = UsageRecorder(engine=db, settings=UsageSettings(spool_dir=tmp_path / "spool"))
    await recorder.start()
    try:
        await recorder.record(make_record(random.Random(13)))  # done at once, nothing to wait for
    finally:
        await recorder.stop()
    assert recorder.journal.disabled and await count_rows(db) == 1


async def test_one_sync_serves_every_line_of_a_loop_turn(tmp_path: Path) -> None:
    journal = UsageJournal(tmp_path, instance_id="one")
    journal.open()
    rng = random.Random(14)
    records = [make_record(rng) for _ in range(50)]
    syncs = JOURNAL_SYNCS._value.get()
    waits = [journal.append(encode(r)) for r in records]
    assert len(set(map(id, waits))) == 1  # one future that every request of the batch awaits
    await waits[0]
    assert JOURNAL_SYNCS._value.get() == syncs + 1
    await journal.append(encode(make_record(rng)))  # the next batch: after the interval at most
    [segment] = segments(tmp_path)
    assert [r.request_id for r in read_segments([segment])][:50] == [r.request_id for r in records]
    journal.close(done_seq=0)


async def test_a_lone_request_never_waits_for_the_commit_interval(tmp_path: Path) -> None:
    """A client alone (each sync served one line) is synced at once; with an hour's interval
    applied to it, this would hang."""
    journal = UsageJournal(tmp_path, instance_id="lone", commit_interval_s=3600)
    journal.open()
    rng = random.Random(15)
    for _ in range(3):
        await asyncio.wait_for(journal.append(encode(make_record(rng))), 60)
    journal.close(done_seq=0)
    assert len(read_segments(segments(tmp_path))) == 3
