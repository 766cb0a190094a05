"""Streaming through a real gateway server: chunks as produced, disconnects abort the engine.

The gateway runs under uvicorn on a real port (httpx's ASGI transport would buffer
whole responses), on the test database and Redis, in front of one fake engine whose
stream pauses after its first delta until the test opens the gate. No timing
assertions: ordering is proved by the gate, completion by events.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_engine import REPLY, FakeEngine, Mode
from live_server import ServerThread, create_inference_key

from gateway.app import create_app
from gateway.config import Settings
from gateway.proxy.outcome import RelayOutcome
from gateway.wiring import gateway_state

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "say hello"}], "stream": True}

pytestmark = pytest.mark.fake_engines(gated=True)


class Outcomes:
    """Completion-hook outcomes recorded from the server thread."""

    def __init__(self) -> None:
        self.items: list[RelayOutcome] = []
        self.arrived = threading.Event()

    async def record(self, outcome: RelayOutcome) -> None:
        self.items.append(outcome)
        self.arrived.set()

    def wait_one(self) -> RelayOutcome:
        assert self.arrived.wait(30), "the completion hook never ran"
        [outcome] = self.items
        return outcome


@pytest.fixture
def outcomes() -> Outcomes:
    return Outcomes()


@pytest.fixture
def gateway(gateway_settings: Settings, outcomes: Outcomes) -> Iterator[ServerThread]:
    app = create_app(gateway_settings)
    server = ServerThread(app).start()  # returns once the app has started: its state exists
    gateway_state(app).completion_hooks.append(outcomes.record)
    yield server
    server.stop()


@pytest.fixture
def http(gateway: ServerThread, gateway_settings: Settings) -> Iterator[httpx.Client]:
    """A client for the live gateway carrying a fresh inference key."""
    assert gateway_settings.admin_key is not None
    secret = create_inference_key(gateway.url, gateway_settings.admin_key.get_secret_value())
    with httpx.Client(
        base_url=gateway.url, timeout=30, headers={"Authorization": f"Bearer {secret}"}
    ) as client:
        yield client


def data_events(lines: Iterator[str]) -> Iterator[Any]:
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            yield payload if payload == "[DONE]" else json.loads(payload)


def chat_text(events: list[Any]) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events if e != "[DONE]" and e["choices"]
    )


def test_chunks_arrive_as_the_engine_produces_them(http: httpx.Client, fake_engine: FakeEngine) -> None:
    assert fake_engine.gate is not None
    with http.stream("POST", "/v1/chat/completions", json=CHAT) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"]
        events = data_events(response.iter_lines())
        role = next(events)
        assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        first = next(events)
        assert first["choices"][0]["delta"]["content"] == REPLY[0]
        # The engine is still paused after its first token: this chunk was relayed, not buffered.
        assert not fake_engine.gate.is_set()
        fake_engine.gate.set()
        rest = list(events)
    assert rest[-1] == "[DONE]"
    assert chat_text([first, *rest]) == "".join(REPLY)
    assert rest[-2]["choices"][0]["finish_reason"] == "stop"


def test_client_disconnect_aborts_the_engine_and_bills_what_it_produced(
    http: httpx.Client, fake_engine: FakeEngine, outcomes: Outcomes
) -> None:
    with http.stream("POST", "/v1/chat/completions", json=CHAT) as response:
        request_id = response.headers["x-request-id"]
        events = data_events(response.iter_lines())
        next(events)  # role
        assert next(events)["choices"][0]["delta"]["content"] == REPLY[0]
    # Leaving the block closed the connection mid-stream; the gate stays shut.
    outcome = outcomes.wait_one()
    assert fake_engine.aborted == [request_id]
    assert outcome.request_id == request_id and outcome.client_disconnected and outcome.status == 499
    assert outcome.finish_reason == "abort" and outcome.usage_exact
    assert (outcome.prompt_tokens, outcome.completion_tokens) == (2, 1)
    assert outcome.duration_s >= outcome.ttft_s  # type: ignore[operator]


def test_client_disconnect_during_a_non_streaming_request_aborts_too(
    gateway: ServerThread, http: httpx.Client, fake_engine: FakeEngine, outcomes: Outcomes
) -> None:
    body = json.dumps(CHAT | {"stream": False}).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        f"authorization: {http.headers['Authorization']}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    before = {status: requests_counted(gateway, status) for status in ("499", "500")}
    with socket.create_connection(("127.0.0.1", gateway.port)) as raw:
        raw.sendall(head + body)
        assert fake_engine.generate_called.wait(30)
    outcome = outcomes.wait_one()
    assert fake_engine.aborted == [outcome.request_id]
    assert outcome.client_disconnected and outcome.finish_reason == "abort" and outcome.completion_tokens == 1
    # Counted (and logged) as the client's doing, 499, like its usage row: not as a 500 (issue 18, defect 7).
    deadline = time.monotonic() + 10
    while requests_counted(gateway, "499") == before["499"]:
        assert time.monotonic() < deadline, "the request was never counted as 499"
        time.sleep(0.05)
    assert requests_counted(gateway, "500") == before["500"]


def requests_counted(gateway: ServerThread, status: str) -> float:
    """``tern_http_requests_total`` for POST /v1/chat/completions with ``status``, from /metrics."""
    metrics = httpx.get(f"{gateway.url}/metrics").text
    pattern = (
        rf'^tern_http_requests_total\{{method="POST",route="/v1/chat/completions",status="{status}"\}} (\S+)$'
    )
    found = re.search(pattern, metrics, re.M)
    return float(found.group(1)) if found else 0.0


def test_stream_with_usage_and_text_completions(
    http: httpx.Client, fake_engine: FakeEngine, outcomes: Outcomes
) -> None:
    assert fake_engine.gate is not None
    fake_engine.gate.set()
    body = {"model": "fake-model", "prompt": "one two three", "stream": True, "max_tokens": 3}
    response = http.post("/v1/completions", json=body | {"stream_options": {"include_usage": True}})
    assert response.status_code == 200
    events = list(data_events(iter(response.text.splitlines())))
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(REPLY[:3])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["prompt_tokens"] == 3 and usage_chunk["usage"]["completion_tokens"] == 3
    outcome = outcomes.wait_one()
    assert outcome.stream and outcome.status == 200 and outcome.completion_tokens == 3


def stream_with_engine_in(
    mode: Mode, http: httpx.Client, fake_engine: FakeEngine
) -> tuple[httpx.Response, list]:
    """One whole streamed chat completion from an ungated engine misbehaving in ``mode``."""
    assert fake_engine.gate is not None
    fake_engine.gate.set()
    fake_engine.mode = mode
    response = http.post("/v1/chat/completions", json=CHAT)
    return response, list(data_events(iter(response.text.splitlines())))


def test_engine_failure_mid_stream_becomes_an_error_event(
    http: httpx.Client, fake_engine: FakeEngine, outcomes: Outcomes
) -> None:
    response, events = stream_with_engine_in("error_midstream", http, fake_engine)
    assert response.status_code == 200  # the stream had begun
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "engine_error" and error["message"]
    assert chat_text(events[:-2]) == "".join(REPLY[:2])
    outcome = outcomes.wait_one()
    assert outcome.status == 500 and outcome.finish_reason == "error" and outcome.completion_tokens == 2
    assert fake_engine.aborted == []


def test_stream_that_ends_without_a_last_frame(
    http: httpx.Client, fake_engine: FakeEngine, outcomes: Outcomes
) -> None:
    response, events = stream_with_engine_in("truncate", http, fake_engine)
    assert events[-2]["error"]["code"] == "engine_stream_broken" and events[-1] == "[DONE]"
    assert chat_text(events[:-2]) == "".join(REPLY[:2])
    outcome = outcomes.wait_one()
    assert outcome.status == 502 and not outcome.usage_exact and outcome.completion_tokens == 2
    # The engine never said it was done: make sure it stops.
    assert fake_engine.aborted == [response.headers["x-request-id"]]
