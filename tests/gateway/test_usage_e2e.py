"""Usage through real gateways: a client disconnect mid-stream is billed for what the engine
produced, and SIGTERM with streams in flight loses nothing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from credentials import TEST_ADMIN_KEY, TEST_SECRET
from fake_engine import REPLY, FakeEngine
from live_server import ServerThread, create_inference_key
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from gateway.app import create_app
from gateway.config import Settings
from tern_stack.services import free_port

ROLLUP_SUMS = "SELECT coalesce(sum(completion_tokens), 0), coalesce(sum(requests), 0) FROM usage_daily"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "say hello"}], "stream": True}


def read_usage(database_url: str) -> list[dict]:
    """All usage rows (checking the rollups agree with them), read from a test thread."""

    async def run() -> list[dict]:
        # One snapshot for both reads: the flusher may commit between two statements otherwise.
        engine = create_async_engine(database_url, isolation_level="REPEATABLE READ")
        async with engine.connect() as conn, conn.begin():
            rows = (
                (await conn.execute(text("SELECT * FROM usage_records ORDER BY started_at"))).mappings().all()
            )
            rollup = (await conn.execute(text(ROLLUP_SUMS))).one()
        await engine.dispose()
        assert int(rollup[0]) == sum(r["completion_tokens"] for r in rows) and int(rollup[1]) == len(rows)
        return [dict(r) for r in rows]

    return asyncio.run(run())


def wait_for_rows(database_url: str, n: int) -> list[dict]:
    deadline = time.monotonic() + 30
    while True:
        rows = read_usage(database_url)
        if len(rows) >= n:
            return rows
        assert time.monotonic() < deadline, f"only {len(rows)} of {n} usage rows arrived"
        time.sleep(0.1)


# ---------------------------------------------------------------- disconnect mid-stream


@pytest.mark.fake_engines(gated=True)
def test_client_disconnect_is_billed_for_what_the_engine_produced(
    fake_engine: FakeEngine, database_url: str, redis_url: str, tmp_path: Path
) -> None:
    settings = Settings(
        database_url=database_url,
        redis_url=redis_url,
        secret=TEST_SECRET,
        admin_key=TEST_ADMIN_KEY,
        engine_urls=[fake_engine.url],
        log_level="WARNING",
    )
    server = ServerThread(create_app(settings)).start()
    try:
        key = create_inference_key(server.url, TEST_ADMIN_KEY, tpm_limit=100_000)
        with httpx.Client(
            base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {key}"}
        ) as http:
            with http.stream("POST", "/v1/chat/completions", json=CHAT) as resp:
                request_id = resp.headers["x-request-id"]
                lines = (line for line in resp.iter_lines() if line.startswith("data: "))
                next(lines)  # role
                assert REPLY[0] in next(lines)
            # The connection is closed after one token; the engine is told to abort.
        [row] = wait_for_rows(database_url, 1)
    finally:
        server.stop()
    assert row["request_id"] == request_id and row["status"] == 499 and row["finish_reason"] == "abort"
    assert row["completion_tokens"] == 1  # exactly what the engine produced before the abort
    assert row["prompt_tokens"] == 2
    assert fake_engine.aborted == [request_id]


# ---------------------------------------------------------------- SIGTERM


@pytest.mark.fake_engines(token_delay_s=0.3)
def test_sigterm_with_streams_in_flight_loses_nothing(
    fake_engine: FakeEngine, database_url: str, redis_url: str, tmp_path: Path
) -> None:
    port = free_port()
    env = {
        **os.environ,
        "TERN_DATABASE_URL": database_url,
        "TERN_REDIS_URL": redis_url,
        "TERN_SECRET": TEST_SECRET,
        "TERN_ADMIN_KEY": TEST_ADMIN_KEY,
        "TERN_ENGINE_URLS": fake_engine.url,
        "TERN_LOG_LEVEL": "WARNING",
        "TERN_USAGE_SPOOL_DIR": str(tmp_path / "spool"),
        "TERN_USAGE_FLUSH_INTERVAL_S": "30",  # nothing flushes on its own: only the drain can
    }
    command = [sys.executable, "-m", "tern_cli", "gateway", "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.1)
        key = create_inference_key(base, TEST_ADMIN_KEY)

        def stream(_: int) -> tuple[str, str]:
            """(the gateway's request id, the streamed text)."""
            with httpx.Client(base_url=base, timeout=60, headers={"Authorization": f"Bearer {key}"}) as http:
                with http.stream("POST", "/v1/chat/completions", json=CHAT) as r:
                    return r.headers["x-request-id"], "".join(
                        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                        for line in r.iter_lines()
                        if line.startswith("data: {") and json.loads(line[6:])["choices"]
                    )

        n = 4
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(stream, i) for i in range(n)]
            while len(fake_engine.received) < n:  # every stream has reached the engine
                time.sleep(0.02)
            process.send_signal(signal.SIGTERM)
            answers = [f.result() for f in futures]
        # uvicorn re-raises the signal once its graceful shutdown (and our lifespan drain) is done.
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert [text for _, text in answers] == ["".join(REPLY)] * n  # in-flight streams were allowed to finish
    rows = read_usage(database_url)  # the gateway is gone: whatever is here came from its drain
    assert sorted(r["request_id"] for r in rows) == sorted(request_id for request_id, _ in answers)
    assert all(r["completion_tokens"] == len(REPLY) and r["status"] == 200 for r in rows)
    assert not list((tmp_path / "spool").glob("*.jsonl"))
