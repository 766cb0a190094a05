"""End to end: Tern's real engine, addressed only through its OpenAI ``/v1`` endpoints
(``openai+http://`` in ``TERN_ENGINE_URLS``), behind a real gateway on real PostgreSQL and Redis.

One engine (the default SmolLM2-135M GGUF, one thread; conftest's ``real_engines``) serves the
module; answers are kept to a few tokens. Usage rows must equal what the engine itself reported, a
client that goes away is billed once, and a killed engine leaves the rotation and comes back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from real_engine import RealEngine
from test_proxy_openai_engine import Gateway, sse_events, start_gateway
from test_usage_e2e import read_usage, wait_for_rows

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
LONG_PROMPT = " ".join(f"Fact {i}: the sky over city number {i} is blue." for i in range(12))
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def engine(real_engines: list[RealEngine]) -> RealEngine:
    return real_engines[0]


@pytest.fixture
def gateway(engine: RealEngine, database_url: str, redis_url: str) -> Iterator[Gateway]:
    gw = start_gateway(
        database_url,
        redis_url,
        [f"openai+{engine.url}"],
        engine_model_map={},
        engine_health_interval_s=0.25,
    )
    yield gw
    gw.http.close()
    gw.server.stop()


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0} | fields


def row_usage(row: dict[str, Any]) -> tuple[int, int, int]:
    return row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"]


def reported(usage: dict[str, Any]) -> tuple[int, int, int]:
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"]


def test_chat_and_completions_streaming_and_not_billed_as_the_engine_reported(gateway: Gateway) -> None:
    answers: list[tuple[str, tuple[int, int, int]]] = []
    resp = gateway.http.post("/v1/chat/completions", json=chat(LONG_PROMPT, max_tokens=4))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert (
        body["id"] == f"chatcmpl-{resp.headers['x-request-id']}" and body["choices"][0]["message"]["content"]
    )
    answers.append((resp.headers["x-request-id"], reported(body["usage"])))

    # The same prompt again: the engine serves its prefix from cache and says so; billed as cached.
    stream = chat(LONG_PROMPT, max_tokens=4, stream=True, stream_options={"include_usage": True})
    with gateway.http.stream("POST", "/v1/chat/completions", json=stream) as resp:
        events = sse_events(resp)
        request_id = resp.headers["x-request-id"]
    assert events[-1] == "[DONE]"
    assert {e["id"] for e in events[:-1]} == {f"chatcmpl-{request_id}"}
    [usage] = [e["usage"] for e in events[:-1] if e.get("usage")]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    answers.append((request_id, reported(usage)))

    resp = gateway.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "The capital", "max_tokens": 3}
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["id"] == f"cmpl-{resp.headers['x-request-id']}"
    answers.append((resp.headers["x-request-id"], reported(resp.json()["usage"])))

    # A stream whose client did not ask for usage: the gateway asked, metered it and kept it to itself.
    body = {"model": MODEL, "prompt": "The capital", "max_tokens": 3, "stream": True}
    with gateway.http.stream("POST", "/v1/completions", json=body) as resp:
        events = sse_events(resp)
        request_id = resp.headers["x-request-id"]
    assert events[-1] == "[DONE]" and not any(e.get("usage") for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])

    rows = {r["request_id"]: r for r in wait_for_rows(gateway.database_url, 4)}
    for rid, usage_tuple in answers:
        assert row_usage(rows[rid]) == usage_tuple and rows[rid]["usage_estimated"] is False
    assert rows[request_id]["completion_tokens"] == 3 and rows[request_id]["usage_estimated"] is False
    assert {r["model"] for r in rows.values()} == {MODEL}


def test_client_disconnect_closes_the_engine_stream_and_is_billed_once(gateway: Gateway) -> None:
    body = chat("Count from one to one hundred.", max_tokens=200, ignore_eos=True, stream=True)
    seen = 0
    with gateway.http.stream("POST", "/v1/chat/completions", json=body) as resp:
        request_id = resp.headers["x-request-id"]
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                seen += 1
                if seen == 2:
                    break
    [row] = wait_for_rows(gateway.database_url, 1)
    assert row["request_id"] == request_id and row["status"] == 499 and row["usage_estimated"] is True
    assert 2 <= row["completion_tokens"] < 200
    # The engine stopped: it takes a new request at once, and no second row appears for the first.
    resp = gateway.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert resp.status_code == 200
    rows = wait_for_rows(gateway.database_url, 2)
    assert [r["request_id"] for r in rows].count(request_id) == 1
    assert len(read_usage(gateway.database_url)) == 2


def wait_until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)


def test_a_dead_engine_leaves_the_rotation_and_comes_back(gateway: Gateway, engine: RealEngine) -> None:
    """Last in the module: it kills the engine (and starts it again, for whoever uses it next)."""
    assert gateway.http.get("/v1/models").json()["data"][0]["id"] == MODEL
    engine.kill()
    wait_until(lambda: httpx.get(f"{gateway.server.url}/readyz").status_code == 503, "the gateway saw it die")
    assert gateway.http.get("/v1/models").json()["data"] == []
    resp = gateway.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_unavailable"

    engine.start()
    wait_until(lambda: httpx.get(f"{gateway.server.url}/readyz").status_code == 200, "the engine was back")
    resp = gateway.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert resp.status_code == 200, resp.text
