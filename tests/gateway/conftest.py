"""Gateway fixtures: an app on a fresh database and the session's Redis, clients and keys.

- ``fake_engines`` / ``fake_engine``: stand-in engines on real ports, for tests marked
  ``@pytest.mark.fake_engines(count=1, gated=False, **FakeEngine fields)``; ``gated`` gives the
  engine a gate that pauses each stream after its first delta until the test sets it.
- ``engine_urls``: the upstreams the app is configured with: the marked fake engines, else none.
- ``gateway_settings``: ``Settings`` pointing at the test database and Redis.
- ``app``: the app with its lifespan running; ``client``: an httpx client bound to it.
- ``admin_headers``: headers carrying the bootstrap platform admin key.
- ``create_tenant_and_key(**key_fields)``: a new tenant and a key for it, through the admin API.
- ``gateway_processes(count, workers=1, **env)``: real ``tern gateway`` subprocesses; returns their base URLs.
- ``real_engines``: two real ``tern engine`` processes (default model, one thread each), started once
  per session on first use, for the end-to-end tests (slow).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from credentials import TEST_ADMIN_KEY, TEST_SECRET, CreateTenantAndKey, bearer
from fake_engine import FakeEngine
from fastapi import FastAPI
from real_engine import RealEngine

from gateway.app import create_app
from gateway.config import Settings
from gateway.proxy.outcome import RelayOutcome
from gateway.wiring import gateway_state
from tern_stack.services import free_port

_tenant_counter = itertools.count()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "fake_engines(count=1, gated=False, **fields): serve the app through started FakeEngines"
    )


@pytest.fixture
def fake_engines(request: pytest.FixtureRequest) -> Iterator[list[FakeEngine]]:
    marker = request.node.get_closest_marker("fake_engines")
    options = dict(marker.kwargs) if marker is not None else {}
    count = options.pop("count", 1)
    gated = options.pop("gated", False)
    engines = [FakeEngine(gate=threading.Event() if gated else None, **options).start() for _ in range(count)]
    yield engines
    for engine in engines:
        engine.stop()


@pytest.fixture
def fake_engine(fake_engines: list[FakeEngine]) -> FakeEngine:
    return fake_engines[0]


@pytest.fixture
def engine_urls(request: pytest.FixtureRequest) -> list[str]:
    """The marked test's fake engines; none for tests that do not proxy."""
    if request.node.get_closest_marker("fake_engines") is None:
        return []
    return [engine.url for engine in request.getfixturevalue("fake_engines")]


@pytest.fixture
def gateway_settings(database_url: str, redis_url: str, engine_urls: list[str]) -> Settings:
    return Settings(
        database_url=database_url,
        redis_url=redis_url,
        secret=TEST_SECRET,
        admin_key=TEST_ADMIN_KEY,
        engine_urls=engine_urls,
        log_json=True,
        log_level="WARNING",
    )


@pytest.fixture
async def app(gateway_settings: Settings) -> AsyncIterator[FastAPI]:
    application = create_app(gateway_settings)
    async with application.router.lifespan_context(application):
        yield application


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        yield http


@pytest.fixture
def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {TEST_ADMIN_KEY}"}


@pytest.fixture
def create_tenant_and_key(client: httpx.AsyncClient, admin_headers: dict[str, str]) -> CreateTenantAndKey:
    """``await create_tenant_and_key(models=[...], rpm_limit=...)`` -> (tenant, key secret, key id)."""

    async def create(**key_fields: Any) -> tuple[dict[str, Any], str, str]:
        name = f"tenant-{os.getpid()}-{next(_tenant_counter)}"
        response = await client.post("/admin/tenants", json={"name": name}, headers=admin_headers)
        assert response.status_code == 201, response.text
        tenant = response.json()
        body = {"tenant_id": tenant["id"], "name": f"{name}-key", "kind": "inference", **key_fields}
        response = await client.post("/admin/keys", json=body, headers=admin_headers)
        assert response.status_code == 201, response.text
        created = response.json()
        return tenant, created["key"], created["id"]

    return create


# An inference key of a new tenant, and the outcomes the completion hooks receive (the proxy tests).
@pytest.fixture
async def key(create_tenant_and_key: CreateTenantAndKey) -> dict[str, str]:
    _, secret, _ = await create_tenant_and_key()
    return bearer(secret)


@pytest.fixture
def outcomes(app: FastAPI) -> list[RelayOutcome]:
    recorded: list[RelayOutcome] = []

    async def record(outcome: RelayOutcome) -> None:
        recorded.append(outcome)

    gateway_state(app).completion_hooks.append(record)
    return recorded


def _wait_healthy(process: subprocess.Popen[bytes], base_url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"gateway process exited with {process.returncode}")
        try:
            if httpx.get(f"{base_url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"gateway process did not become healthy in {timeout_s} s")
        time.sleep(0.1)


@pytest.fixture
def gateway_processes(gateway_settings: Settings) -> Iterator[Callable[..., list[str]]]:
    """``gateway_processes(count, workers=1, **env)`` starts ``count`` real gateways (in parallel),
    each with ``workers`` worker processes, sharing the test database and Redis, and returns their
    base URLs; all are stopped after the test."""
    processes: list[subprocess.Popen[bytes]] = []

    def start(count: int = 1, workers: int = 1, **env_overrides: str) -> list[str]:
        env = {
            **os.environ,
            "TERN_DATABASE_URL": gateway_settings.database_url,
            "TERN_REDIS_URL": gateway_settings.redis_url,
            "TERN_SECRET": TEST_SECRET,
            "TERN_ADMIN_KEY": TEST_ADMIN_KEY,
            "TERN_ENGINE_URLS": ",".join(gateway_settings.engine_urls),
            "TERN_LOG_LEVEL": "WARNING",
            **env_overrides,
        }
        started = []
        for _ in range(count):
            port = free_port()
            command = [
                sys.executable,
                "-m",
                "tern_cli",
                "gateway",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                str(workers),
            ]
            process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)
            processes.append(process)
            started.append((process, f"http://127.0.0.1:{port}"))
        for process, base_url in started:
            _wait_healthy(process, base_url)
        return [base_url for _, base_url in started]

    yield start
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def real_engines() -> Iterator[list[RealEngine]]:
    """Started together (the load is the slow part), shared by every end-to-end module that needs
    real engines; a test that kills one starts it again."""
    log_dir = Path(tempfile.mkdtemp(prefix="tern-real-engines-"))
    started = [RealEngine(log_dir).launch() for _ in range(2)]
    try:
        for engine in started:
            engine.wait_ready()
        yield started
    finally:
        for engine in started:
            engine.stop()
