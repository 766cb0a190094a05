"""The journal as the one durable usage queue: batches an older gateway's spool left are replayed
once on upgrade, and what Postgres rejects for its content is quarantined instead of retried forever."""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import pool, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from test_usage import count_rows, make_record

from gateway.metrics import USAGE_QUARANTINED
from gateway.usage.config import UsageSettings
from gateway.usage.journal import encode, read_segments, segments
from gateway.usage.recorder import UsageRecorder
from gateway.usage.schemas import UsageRecord

pytestmark = pytest.mark.anyio


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(database_url, poolclass=pool.NullPool)
    yield engine
    await engine.dispose()


def write_old_spool_file(directory: Path, records: list[UsageRecord]) -> Path:
    """A frozen copy of the retired ``gateway/usage/spool.py`` (at ee76093): one JSON-lines file a
    batch, ``json.dumps(record.to_json())`` a line, named ``<ns>-<pid>-<8 hex>.jsonl``."""
    directory.mkdir(parents=True, exist_ok=True)
    name = f"{time.time_ns():020d}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
    with open(directory / name, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record.to_json(), separators=(",", ":")) + "\n")
    return directory / name


async def test_an_old_spool_file_is_replayed_once_on_upgrade(db: AsyncEngine, tmp_path: Path) -> None:
    rng = random.Random(31)
    records = [replace(make_record(rng), reasoning_tokens=7, end_user="u1") for _ in range(30)]
    spooled = write_old_spool_file(tmp_path / "spool", records)
    # A line spooled before usage_estimated, end_user and reasoning_tokens existed still reads.
    oldest = make_record(rng)
    line = oldest.to_json()
    for field in ("usage_estimated", "end_user", "reasoning_tokens"):
        del line[field]
    spooled.write_text(spooled.read_text(encoding="utf-8") + json.dumps(line) + "\n", encoding="utf-8")

    recorder = UsageRecorder(engine=db, settings=UsageSettings(spool_dir=tmp_path / "spool"))
    await recorder.start()  # the upgraded gateway's first replay
    try:
        assert not spooled.exists()
        assert await count_rows(db) == 31
        assert await recorder.replay_journals() == 0  # once
    finally:
        await recorder.stop()
    async with db.connect() as conn:
        reasoning = (await conn.execute(text("SELECT sum(reasoning_tokens) FROM usage_records"))).scalar_one()
    assert reasoning == 7 * 30


async def test_a_dead_segment_postgres_rejects_is_quarantined_not_retried_forever(
    db: AsyncEngine,
    tmp_path: Path,
) -> None:
    rng = random.Random(32)
    good = [make_record(rng) for _ in range(5)]
    bad = replace(make_record(rng), status=70_000)  # out of the column's smallint range
    journal = tmp_path / "journal"
    journal.mkdir()
    segment = journal / f"{1:020d}-deadbeef.journal"
    lines = [encode(r) for r in [*good[:2], bad, *good[2:]]]
    segment.write_bytes(b"".join(lines) + b"not json\n" + encode(good[0]))

    quarantined = USAGE_QUARANTINED._value.get()
    recorder = UsageRecorder(engine=db, settings=UsageSettings(journal_dir=journal))
    assert await recorder.replay_journals() == 5  # the rest is stored ...
    assert not segment.exists() and segments(journal) == []  # ... and nothing is left to retry
    rejected = segments(journal / "rejected")
    assert [r.request_id for r in read_segments(rejected)] == [bad.request_id]
    assert b"not json\n" in b"".join(p.read_bytes() for p in rejected)
    assert USAGE_QUARANTINED._value.get() - quarantined == 2
    assert await count_rows(db) == 5
    assert await recorder.replay_journals() == 0


def test_the_journal_dir_and_its_deprecated_alias(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TERN_USAGE_SPOOL_DIR", raising=False)
    monkeypatch.setenv("TERN_USAGE_JOURNAL_DIR", str(tmp_path / "usage" / "journal"))
    settings = UsageSettings()
    assert settings.journal_path == tmp_path / "usage" / "journal"
    assert settings.legacy_spool_dir == tmp_path / "usage"  # where the old spool wrote, beside it
    monkeypatch.delenv("TERN_USAGE_JOURNAL_DIR")
    monkeypatch.setenv("TERN_USAGE_SPOOL_DIR", str(tmp_path / "old"))
    settings = UsageSettings()
    assert settings.journal_path == tmp_path / "old" / "journal"
    assert settings.legacy_spool_dir == tmp_path / "old"
