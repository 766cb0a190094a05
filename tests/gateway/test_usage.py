"""Usage metering against real Postgres: exactly once under replay, rollups equal raw sums,
monthly partitions with retention, and a Postgres outage (a real server stopped and restarted)
during traffic with nothing lost."""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import pool, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from gateway.db import upgrade_database
from gateway.usage.batch_writer import write_batch
from gateway.usage.config import UsageSettings
from gateway.usage.journal import read_segments, segments
from gateway.usage.partitions import add_months, existing_partitions, maintain, month_floor
from gateway.usage.recorder import UsageRecorder
from gateway.usage.schemas import UsageRecord
from tern_stack.services import PostgresServer

pytestmark = pytest.mark.anyio

TENANTS = [str(uuid.uuid4()) for _ in range(2)]
KEYS = {t: [str(uuid.uuid4()) for _ in range(2)] for t in TENANTS}


def make_record(rng: random.Random, started_at: datetime | None = None) -> UsageRecord:
    tenant = rng.choice(TENANTS)
    prompt = rng.randint(0, 500)
    started = started_at or datetime.now(UTC) - timedelta(
        days=rng.randint(0, 2), seconds=rng.randint(0, 3600)
    )
    return UsageRecord(
        request_id=uuid.UUID(int=rng.getrandbits(128)).hex,
        tenant_id=tenant,
        key_id=rng.choice(KEYS[tenant]),
        model=rng.choice(["m-small", "m-large"]),
        endpoint="chat.completions",
        prompt_tokens=prompt,
        cached_tokens=rng.randint(0, prompt),
        completion_tokens=rng.randint(0, 300),
        status=rng.choice([200, 200, 200, 499, 502]),
        finish_reason=rng.choice(["stop", "length", "abort", "error"]),
        ttft_ms=rng.random() * 100,
        duration_ms=rng.random() * 1000,
        started_at=started,
        finished_at=started + timedelta(seconds=1),
    )


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(database_url, poolclass=pool.NullPool)
    yield engine
    await engine.dispose()


async def raw_and_rollup_sums(engine: AsyncEngine) -> tuple[dict, dict]:
    metrics = "count(*), count(*) FILTER (WHERE status >= 400 OR finish_reason = 'error'), "
    metrics += "sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens)"
    raw_sql = f"""SELECT (started_at AT TIME ZONE 'UTC')::date, tenant_id, key_id, model, {metrics}
                  FROM usage_records GROUP BY 1, 2, 3, 4"""
    rollup_sql = """SELECT day, tenant_id, key_id, model, requests, errors, prompt_tokens, cached_tokens,
                    completion_tokens FROM usage_daily"""
    async with engine.connect() as conn:
        raw = {tuple(r[:4]): tuple(int(v) for v in r[4:]) for r in await conn.execute(text(raw_sql))}
        rollups = {tuple(r[:4]): tuple(int(v) for v in r[4:]) for r in await conn.execute(text(rollup_sql))}
    return raw, rollups


async def count_rows(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text("SELECT count(*) FROM usage_records"))).scalar_one())


async def test_replays_never_count_twice_and_rollups_equal_raw_sums(db: AsyncEngine) -> None:
    rng = random.Random(4)
    records = [make_record(rng) for _ in range(300)]
    known: set[date] = set()
    assert await write_batch(db, records[:200], known_months=known) == 200
    # A replay of a whole batch, an overlapping batch, and duplicates inside one batch.
    assert await write_batch(db, records[:200], known_months=known) == 0
    assert await write_batch(db, records[150:] + records[290:], known_months=known) == 100
    assert await count_rows(db) == 300

    raw, rollups = await raw_and_rollup_sums(db)
    assert rollups == raw
    expected = Counter()
    for r in records:
        expected["prompt"] += r.prompt_tokens
        expected["completion"] += r.completion_tokens
        expected["errors"] += r.is_error
    assert sum(v[2] for v in rollups.values()) == expected["prompt"]
    assert sum(v[4] for v in rollups.values()) == expected["completion"]
    assert sum(v[1] for v in rollups.values()) == expected["errors"]


async def test_recorder_batches_and_drains_on_stop(db: AsyncEngine, tmp_path: Path) -> None:
    settings = UsageSettings(flush_interval_s=60, batch_size=1000, spool_dir=tmp_path / "spool")
    recorder = UsageRecorder(engine=db, settings=settings)
    await recorder.start()
    rng = random.Random(5)
    for _ in range(250):
        recorder.record(make_record(rng))
    assert recorder.pending == 250 and await count_rows(db) == 0  # buffered, not one transaction each
    await recorder.stop()  # what the lifespan does on SIGTERM
    assert recorder.pending == 0 and await count_rows(db) == 250
    assert not list((tmp_path / "spool").glob("*.jsonl"))


async def test_retention_drops_whole_old_months_and_keeps_rollups(db: AsyncEngine) -> None:
    this_month = month_floor(datetime.now(UTC))
    old, recent = add_months(this_month, -5), add_months(this_month, -1)
    rng = random.Random(6)
    records = [
        make_record(rng, datetime(m.year, m.month, 3, 12, tzinfo=UTC))
        for m in (old, recent)
        for _ in range(5)
    ]
    await write_batch(db, records, known_months=set())
    async with db.begin() as conn:
        dropped = await maintain(conn, ahead=2, retention_months=3)
        partitions = await existing_partitions(conn)
        rollup_requests = (await conn.execute(text("SELECT sum(requests) FROM usage_daily"))).scalar_one()
    assert dropped == [f"usage_records_p{old:%Y%m}"]
    assert set(partitions) == {recent, this_month, add_months(this_month, 1), add_months(this_month, 2)}
    assert await count_rows(db) == 5
    assert rollup_requests == 10  # reports over old months still work from the rollups


# ---------------------------------------------------------------- a Postgres outage


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL of this test's own, so stopping it disturbs nobody else. Its data lives in a
    folder we own (not a throwaway one that ``stop()`` deletes), so it can be restarted."""
    root = Path(tempfile.mkdtemp(prefix="tern-pg-outage-", dir="/tmp"))
    root.chmod(0o711)  # PostgreSQL's unprivileged account must reach its data dir below
    server = PostgresServer(data_dir=root / "pg").start()
    try:
        server.create_database("tern")
        upgrade_database(server.url("tern"))
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


async def wait_for(predicate, within_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)


async def test_postgres_outage_during_traffic_loses_nothing(
    own_postgres: PostgresServer, tmp_path: Path
) -> None:
    engine = create_async_engine(own_postgres.url("tern"), pool_pre_ping=True)
    spool_dir = tmp_path / "spool"
    settings = UsageSettings(flush_interval_s=0.05, batch_size=20, replay_interval_s=0.2, spool_dir=spool_dir)
    recorder = UsageRecorder(engine=engine, settings=settings)
    await recorder.start()
    rng = random.Random(7)
    sent: list[UsageRecord] = []

    async def traffic(n: int) -> None:
        for _ in range(n):
            record = make_record(rng)
            sent.append(record)
            recorder.record(record)
            await asyncio.sleep(0.002)

    try:
        await traffic(100)
        await wait_for(lambda: _ready(lambda: count_rows(engine), 100))
        own_postgres.stop()  # pg_ctl stop -m fast, mid-traffic
        await traffic(150)
        await wait_for(lambda: _true(not recorder.postgres_ok))
        assert recorder.pending >= 1  # the failed batches wait in the buffer, their segments on disk
        assert segments(spool_dir / "journal")
        own_postgres.start()
        await traffic(50)
        await wait_for(lambda: _ready(lambda: count_rows(engine), 300))
        await wait_for(lambda: _true(recorder.pending == 0))
    finally:
        await recorder.stop()
    assert await count_rows(engine) == len(sent) == 300
    raw, rollups = await raw_and_rollup_sums(engine)
    assert rollups == raw
    assert sum(v[4] for v in rollups.values()) == sum(r.completion_tokens for r in sent)
    await engine.dispose()


async def test_records_journaled_at_shutdown_are_replayed_by_the_next_process(
    own_postgres: PostgresServer, tmp_path: Path
) -> None:
    engine = create_async_engine(own_postgres.url("tern"), pool_pre_ping=True)
    settings = UsageSettings(flush_interval_s=60, spool_dir=tmp_path / "spool")
    recorder = UsageRecorder(engine=engine, settings=settings)
    await recorder.start()
    rng = random.Random(8)
    records = [make_record(rng) for _ in range(40)]
    for record in records:
        recorder.record(record)
    own_postgres.stop()
    await recorder.stop()  # Postgres is down: the records stay in the journal instead of being lost
    assert len(read_segments(segments(tmp_path / "spool" / "journal"))) == 40

    own_postgres.start()
    await engine.dispose()
    engine = create_async_engine(own_postgres.url("tern"), pool_pre_ping=True)
    successor = UsageRecorder(engine=engine, settings=settings)
    assert await successor.replay_journals() == 40
    assert await successor.replay_journals() == 0
    assert await count_rows(engine) == 40
    await engine.dispose()


async def _ready(counter, target: int) -> bool:  # type: ignore[no-untyped-def]
    try:
        return await counter() >= target
    except Exception:
        return False


async def _true(value: bool) -> bool:
    return value
