"""The ``tern`` command's gateway-side subcommands, run in-process against a real database."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest
from sqlalchemy import pool
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from gateway.keys.auth import KeyAuthenticator
from gateway.keys.format import has_valid_checksum
from tern_cli import main
from tern_stack.services import PostgresServer

SECRET = "cli-test-secret-0123456789"


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_migrate_then_create_tenant_and_key(
    postgres_server: PostgresServer,
    fresh_database_name: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = postgres_server.url(fresh_database_name(prefix="tern_cli"))
    monkeypatch.setenv("TERN_DATABASE_URL", url)
    monkeypatch.setenv("TERN_SECRET", SECRET)

    assert main(["migrate"]) == 0
    assert "upgraded" in capsys.readouterr().out

    tenant = run_json(capsys, "admin", "create-tenant", "acme")
    assert tenant["name"] == "acme" and tenant["status"] == "active"
    created = run_json(
        capsys, "admin", "create-key", "--tenant-id", tenant["id"], "--name", "app", "--models", "a,b",
        "--rpm-limit", "60",
    )  # fmt: skip
    assert (
        has_valid_checksum(created["key"]) and created["models"] == ["a", "b"] and created["rpm_limit"] == 60
    )

    async def authenticate() -> tuple:
        engine = create_async_engine(url, poolclass=pool.NullPool)
        try:
            authenticator = KeyAuthenticator(
                sessionmaker=async_sessionmaker(engine), secret=SECRET.encode(), cache_ttl_s=0,
                last_used_interval_s=60,
            )  # fmt: skip
            key = await authenticator.authenticate(created["key"])
            return str(key.tenant_id), key.kind
        finally:
            await engine.dispose()

    assert asyncio.run(authenticate()) == (tenant["id"], "inference")


def test_inference_key_without_tenant_is_refused(
    postgres_server: PostgresServer,
    migrated_template: str,
    fresh_database_name: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(
        "TERN_DATABASE_URL", postgres_server.url(fresh_database_name(template=migrated_template))
    )
    monkeypatch.setenv("TERN_SECRET", SECRET)
    assert main(["admin", "create-key", "--name", "x", "--kind", "inference"]) == 1
    assert "tenant_id is required" in capsys.readouterr().err
