"""Fault test: the engine, then the gateway, is SIGKILLed under ``tern up`` (issue 18, defect 9; issue 35).

The real default model, the real stack. Several clients stream with ``logprobs`` (one entry per
token, so each client knows exactly how many tokens it received); once every one has some tokens
the engine is killed. Then: every stream ends with an error event, not a dropped connection; the
gateway answers ``503 engine_unavailable`` while ``tern up`` restarts the engine with backoff; it
serves again without anyone restarting anything else; and the usage rows bill each request exactly
once, for exactly the tokens its client received.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from running_stack import RunningStack, sessions_alive, start_stack

pytestmark = pytest.mark.slow

CLIENTS = 3
FIRST_TOKENS = 3
"""Each client has received this many tokens before the engine is killed."""
RECOVERY_DEADLINE_S = 180.0
USAGE_DEADLINE_S = 30.0
SERVED_MODEL_NAME = "crash-test-model"
"""Given to ``tern up --served-model-name`` (issue 18), which passes it to the engine."""


@dataclass
class StreamedRequest:
    """What one streaming client saw."""

    prompt: str
    request_id: str | None = None
    tokens: int = 0
    error_code: str | None = None
    finished: bool = False
    reported_completion_tokens: int | None = None
    got_first_tokens: threading.Event = field(default_factory=threading.Event)
    failure: BaseException | None = None


def stream(url: str, key: str, model: str, request: StreamedRequest) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": request.prompt}],
        "max_tokens": 400,
        "temperature": 0,
        "logprobs": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        with (
            httpx.Client(timeout=60.0) as client,
            client.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            ) as response,
        ):
            assert response.status_code == 200, response.read()
            request.request_id = response.headers["x-request-id"]
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    request.error_code = event["error"]["code"]
                    continue
                if event.get("usage"):
                    request.reported_completion_tokens = event["usage"]["completion_tokens"]
                for choice in event["choices"]:
                    request.tokens += len((choice.get("logprobs") or {}).get("content") or [])
                    request.finished |= choice.get("finish_reason") is not None
                if request.tokens >= FIRST_TOKENS:
                    request.got_first_tokens.set()
    except BaseException as exc:  # reported by the test, not lost in the thread
        request.failure = exc
    finally:
        request.got_first_tokens.set()


def usage_rows(dsn: str, key_id: str) -> list[dict[str, Any]]:
    async def fetch() -> list[dict[str, Any]]:
        conn = await asyncpg.connect(dsn)
        try:
            rows = await conn.fetch(
                "SELECT request_id, status, completion_tokens FROM usage_records WHERE key_id = $1",
                key_id,
            )
            return [dict(row) for row in rows]
        finally:
            await conn.close()

    return asyncio.run(fetch())


def rows_of_request(dsn: str, request_id: str) -> list[dict[str, Any]]:
    async def fetch() -> list[dict[str, Any]]:
        conn = await asyncpg.connect(dsn)
        try:
            rows = await conn.fetch(
                "SELECT completion_tokens FROM usage_records WHERE request_id = $1", request_id
            )
            return [dict(row) for row in rows]
        finally:
            await conn.close()

    return asyncio.run(fetch())


@pytest.fixture(scope="module")
def stack() -> Iterator[RunningStack]:
    # Not pytest's tmp_path: that is 0700, and PostgreSQL runs as another account when we are root.
    workdir = Path(tempfile.mkdtemp(prefix="tern-crash-", dir="/tmp"))
    workdir.chmod(0o711)
    running = start_stack(workdir / ".tern", args=("--served-model-name", SERVED_MODEL_NAME))
    try:
        yield running
    finally:
        if running.process.poll() is None:
            os.killpg(running.process.pid, signal.SIGTERM)
            running.process.wait(timeout=90)
        shutil.rmtree(workdir, ignore_errors=True)


def test_tern_up_serves_the_model_under_the_name_given(stack: RunningStack) -> None:
    models = httpx.get(f"{stack.url}/v1/models", headers={"Authorization": f"Bearer {stack.demo_key}"})
    assert [model["id"] for model in models.json()["data"]] == [SERVED_MODEL_NAME]


def test_engine_sigkill_mid_stream_is_survived_and_billed_exactly_once(stack: RunningStack) -> None:
    admin = {"Authorization": f"Bearer {stack.admin_key}"}
    tenant = httpx.post(f"{stack.url}/admin/tenants", json={"name": "crash"}, headers=admin).json()
    made = httpx.post(
        f"{stack.url}/admin/keys",
        json={"tenant_id": tenant["id"], "name": "crash test", "kind": "inference"},
        headers=admin,
    ).json()
    key, key_id = made["key"], made["id"]
    auth = {"Authorization": f"Bearer {key}"}
    model = httpx.get(f"{stack.url}/v1/models", headers=auth).json()["data"][0]["id"]
    pids_before = dict(stack.info["pids"])

    # Several streams in flight, each with some tokens received; then the engine dies.
    requests = [
        StreamedRequest(f"Count from 1 to 500, one number per line. Start at {n}.") for n in range(CLIENTS)
    ]
    threads = [threading.Thread(target=stream, args=(stack.url, key, model, r)) for r in requests]
    for thread in threads:
        thread.start()
    for request in requests:
        assert request.got_first_tokens.wait(120), "a stream got no tokens"
    os.kill(pids_before["engine"], signal.SIGKILL)
    for thread in threads:
        thread.join(60)
    for request in requests:
        assert request.failure is None, repr(request.failure)
        assert request.request_id is not None and request.tokens >= FIRST_TOKENS
        if not request.finished:  # cut by the crash: told so in the stream, not a dropped connection
            assert request.error_code == "engine_stream_broken", request
        else:  # finished before the kill landed
            assert request.reported_completion_tokens == request.tokens

    # While the engine restarts the gateway keeps answering: 503 engine_unavailable, then 200.
    refused, answered, answered_id = 0, None, None
    deadline = time.monotonic() + RECOVERY_DEADLINE_S
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    while answered is None:
        assert time.monotonic() < deadline, "the engine did not come back"
        response = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=auth, timeout=60)
        if response.status_code == 200:
            answered, answered_id = response.json(), response.headers["x-request-id"]
        else:
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "engine_unavailable", response.text
            refused += 1
            time.sleep(0.2)
    assert refused > 0, "no request saw the engine missing"
    assert stack.process.poll() is None, stack.log()

    # Only the engine was restarted, and tern up says so; run.json has the new pid.
    output = stack.log()
    assert "The engine was killed by SIGKILL; restarting it in 1 s" in output, output
    assert "The engine restarted" in output, output
    pids_after = json.loads((stack.data_dir / "run.json").read_text())["pids"]
    assert pids_after["engine"] != pids_before["engine"]
    assert {k: v for k, v in pids_after.items() if k != "engine"} == {
        k: v for k, v in pids_before.items() if k != "engine"
    }

    # Usage: one row per request, for exactly what its client received; nothing for refusals.
    received = {r.request_id: r.tokens for r in requests}
    deadline = time.monotonic() + USAGE_DEADLINE_S
    while True:  # usage is buffered and flushed in the background
        rows = usage_rows(stack.info["postgres_dsn"], key_id)
        if {*received, answered_id} <= {row["request_id"] for row in rows} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    by_request: dict[str, list[int]] = {}
    for row in rows:
        by_request.setdefault(row["request_id"], []).append(row["completion_tokens"])
    assert all(len(counts) == 1 for counts in by_request.values()), "a request was billed twice"
    assert {rid: by_request.get(rid, [None])[0] for rid in received} == received
    assert (
        sum(counts[0] for counts in by_request.values())
        == sum(received.values()) + (answered["usage"]["completion_tokens"])
    ), "the refused requests are billed nothing"


def test_gateway_sigkill_is_restarted_by_tern_up_and_bills_what_it_served(stack: RunningStack) -> None:
    """The gateway dies like an OOM kill: tern up starts it again with the engine's backoff and
    messages, and an answer it completed before dying is billed (its journal is replayed)."""
    auth = {"Authorization": f"Bearer {stack.demo_key}"}
    body = {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    served = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=auth, timeout=60)
    assert served.status_code == 200, served.text
    pids_before = json.loads((stack.data_dir / "run.json").read_text())["pids"]
    os.kill(pids_before["gateway"], signal.SIGKILL)  # before its buffer's next flush, most likely

    deadline = time.monotonic() + RECOVERY_DEADLINE_S
    while True:
        assert time.monotonic() < deadline, stack.log()
        try:
            again = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=auth, timeout=60)
            if again.status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    output = stack.log()
    assert "The gateway was killed by SIGKILL; restarting it in 1 s" in output, output
    assert "The gateway restarted" in output, output
    pids_after = json.loads((stack.data_dir / "run.json").read_text())["pids"]
    assert pids_after["gateway"] != pids_before["gateway"] and pids_after["engine"] == pids_before["engine"]

    served_id = served.headers["x-request-id"]
    deadline = time.monotonic() + USAGE_DEADLINE_S
    while True:
        billed = rows_of_request(stack.info["postgres_dsn"], served_id)
        if billed or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [r["completion_tokens"] for r in billed] == [served.json()["usage"]["completion_tokens"]]


def test_the_stack_still_stops_cleanly_restarted_children_included(stack: RunningStack) -> None:
    pids = json.loads((stack.data_dir / "run.json").read_text())["pids"]
    assert stack.stop() == 0, stack.log()
    assert not sessions_alive(set(pids.values())), stack.log()
