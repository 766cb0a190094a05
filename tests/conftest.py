"""Session-wide real servers: one PostgreSQL and one Redis, started on first use, stopped at the end.

Each test that asks for ``database_url`` gets its own fresh, migrated database, cloned from a
template that is migrated once per session (``CREATE DATABASE ... TEMPLATE`` takes milliseconds).
Tests that need neither server (most engine tests) start nothing. No torch import here.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Callable, Iterator

import pytest
import redis

from gateway.db import upgrade_database
from tern_stack.services import PostgresServer, RedisServer

TEMPLATE_DB = "tern_template"

# Gateways started by this session journal their usage in a directory of the session's own (unless a
# test gives one): a journal an interrupted session left in .tern/ must not be replayed into the
# database of a test in the next one.
os.environ.setdefault("TERN_USAGE_SPOOL_DIR", tempfile.mkdtemp(prefix="tern-test-spool-"))
_db_counter = itertools.count()


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    with PostgresServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def migrated_template(postgres_server: PostgresServer) -> str:
    """A database migrated to head once per session; tests clone it."""
    postgres_server.drop_database(TEMPLATE_DB)
    postgres_server.create_database(TEMPLATE_DB)
    upgrade_database(postgres_server.url(TEMPLATE_DB))
    return TEMPLATE_DB


@pytest.fixture
def fresh_database_name(postgres_server: PostgresServer) -> Iterator[Callable[..., str]]:
    """Factory for extra databases (empty, or cloned from a template); all dropped after the test."""
    created: list[str] = []

    def make(*, template: str | None = None, prefix: str = "tern_test") -> str:
        name = f"{prefix}_{os.getpid()}_{next(_db_counter)}"
        postgres_server.create_database(name, template=template)
        created.append(name)
        return name

    yield make
    for name in created:
        postgres_server.drop_database(name)


@pytest.fixture
def database_url(
    postgres_server: PostgresServer, migrated_template: str, fresh_database_name: Callable[..., str]
) -> str:
    """A fresh database at the latest migration, dropped after the test."""
    return postgres_server.url(fresh_database_name(template=migrated_template))


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """The session's Redis, emptied before each test."""
    url = redis_server.url()
    client = redis.Redis.from_url(url)
    try:
        client.flushall()
    finally:
        client.close()
    yield url
