"""Local servers for ``tern up``: with a data dir, PostgreSQL and Redis keep their data across restarts."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tern_stack.services import PostgresServer, RedisServer


@pytest.fixture
def data_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="tern-up-test-", dir="/tmp"))
    os.chmod(path, 0o755)  # PostgreSQL's unprivileged user must be able to reach its folder
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_postgres_reuses_its_data_dir(data_dir: Path) -> None:
    with PostgresServer(data_dir=data_dir / "postgres") as first:
        first.create_database("tern")
        first.execute("CREATE TABLE kept (v int)", "INSERT INTO kept VALUES (7)", database="tern")
    assert not first.started and (data_dir / "postgres" / "data" / "PG_VERSION").exists()

    with PostgresServer(data_dir=data_dir / "postgres") as second:
        assert second.database_exists("tern")
        second.create_database("tern", exist_ok=True)  # idempotent, as `tern up` calls it
        second.execute("INSERT INTO kept VALUES (8)", database="tern")
    assert (data_dir / "postgres").exists()  # a given data dir is never deleted


def test_redis_reuses_its_data_dir(data_dir: Path) -> None:
    with RedisServer(data_dir=data_dir / "redis") as first:
        client = redis.Redis.from_url(first.url())
        client.set("kept", "yes")
        client.close()
    with RedisServer(data_dir=data_dir / "redis") as second:
        client = redis.Redis.from_url(second.url())
        assert client.get("kept") == b"yes"
        client.close()


def test_throwaway_servers_clean_up() -> None:
    with PostgresServer() as pg, RedisServer() as server:
        pg_root = pg.root
        assert redis.Redis.from_url(server.url()).ping()
    assert not pg_root.exists()
