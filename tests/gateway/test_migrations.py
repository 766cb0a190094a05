"""Migrations upgrade an empty database, match the models, and downgrade cleanly to base."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, pool
from sqlalchemy.ext.asyncio import create_async_engine

from gateway.db import Base, alembic_config, all_models, downgrade_database, upgrade_database
from tern_stack.services import PostgresServer

CORE_TABLES = {"tenants", "api_keys", "audit_log"}


@pytest.fixture
def empty_database_url(postgres_server: PostgresServer, fresh_database_name: Callable[..., str]) -> str:
    return postgres_server.url(fresh_database_name(prefix="tern_migrations"))


def _inspect(url: str, fn):
    async def _run():
        engine = create_async_engine(url, poolclass=pool.NullPool)
        async with engine.connect() as conn:
            result = await conn.run_sync(fn)
        await engine.dispose()
        return result

    return asyncio.run(_run())


def _tables(url: str) -> set[str]:
    return _inspect(url, lambda conn: set(inspect(conn).get_table_names()))


def _schema_diff(url: str) -> list:
    all_models()
    return _inspect(url, lambda conn: compare_metadata(MigrationContext.configure(conn), Base.metadata))


def test_core_revision_id_is_stable() -> None:
    """Later migrations chain onto this id, so it is a contract."""
    scripts = ScriptDirectory.from_config(alembic_config("postgresql+asyncpg://unused/x"))
    assert scripts.get_revision("0001_core").down_revision is None


def test_upgrade_from_empty_then_downgrade_to_base(empty_database_url: str) -> None:
    assert _tables(empty_database_url) == set()

    upgrade_database(empty_database_url)
    assert CORE_TABLES <= _tables(empty_database_url)
    assert _schema_diff(empty_database_url) == [], "models and migrations disagree"

    downgrade_database(empty_database_url, "base")
    assert _tables(empty_database_url) <= {"alembic_version"}

    upgrade_database(empty_database_url)  # and back up again, from a downgraded database
    assert CORE_TABLES <= _tables(empty_database_url)
