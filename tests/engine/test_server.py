"""The engine's HTTP server over a real socket: OpenAI API (SDK and raw), internal RPC,
errors, SSE, UTF-8-safe streaming, aborts and client disconnects freeing KV blocks."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from engine.core.llm_engine import LLMEngine
from engine.loader import LoadedModel
from engine.serving.server import create_app
from protocol.rpc import DeltaFrame, FinalFrame, parse_frame
from tests.engine.tiny_engine import blocks_held_by_requests, make_tiny_engine
from tests.gateway.live_server import ServerThread


@pytest.fixture(scope="module")
def tiny_server() -> Iterator[tuple[ServerThread, LLMEngine]]:
    engine = make_tiny_engine(max_model_len=128)
    server = ServerThread(create_app(engine)).start()
    yield server, engine
    server.stop()


@pytest.fixture
def url(tiny_server: tuple[ServerThread, LLMEngine]) -> str:
    return tiny_server[0].url


@pytest.fixture
def engine(tiny_server: tuple[ServerThread, LLMEngine]) -> LLMEngine:
    return tiny_server[1]


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def wait_until(condition: Callable[[], bool], timeout: float = 30) -> bool:
    """Poll for a state the server reaches asynchronously (not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def rpc_frames(url: str, body: dict) -> list:
    with httpx.stream("POST", f"{url}/rpc/v1/generate", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        return [parse_frame(line) for line in response.iter_lines() if line]


def sse_events(response: httpx.Response) -> list[dict | str]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_health_and_models(url: str) -> None:
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    health = httpx.get(f"{url}/rpc/v1/health").json()
    assert health["status"] == "ok" and health["model"] == "tiny"
    for path in ("/v1/models", "/rpc/v1/models"):
        models = httpx.get(f"{url}{path}").json()
        assert models["object"] == "list"
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 128


def test_chat_and_completion_through_the_openai_sdk(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert chat.choices[0].finish_reason == "length" and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 6 and chat.usage.prompt_tokens > 2
    text = client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0, n=2)
    assert [c.index for c in text.choices] == [0, 1] and text.choices[0].text == text.choices[1].text
    assert text.usage.prompt_tokens == 5 and text.usage.completion_tokens == 10


def test_streaming_matches_the_whole_response_and_reports_usage(client: openai.OpenAI) -> None:
    params = dict(
        model="tiny", messages=[{"role": "user", "content": "stream me"}], max_tokens=8, temperature=0
    )
    whole = client.chat.completions.create(**params)
    chunks = list(
        client.chat.completions.create(**params, stream=True, stream_options={"include_usage": True})
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
    without_usage = list(client.chat.completions.create(**params, stream=True))
    assert all(c.usage is None for c in without_usage)


def test_completions_sse_wire_format(url: str) -> None:
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" for e in events[:-1])


def test_rpc_generate_streams_frames_ending_in_one_final(url: str) -> None:
    frames = rpc_frames(
        url, {"request_id": "rpc-1", "prompt": "hello", "sampling": {"max_tokens": 5, "ignore_eos": True}}
    )
    assert all(isinstance(f, DeltaFrame) for f in frames[:-1])
    final = frames[-1]
    assert isinstance(final, FinalFrame)
    assert (final.prompt_tokens, final.completion_tokens, final.finish_reason) == (5, 5, "length")
    assert sum(len(f.token_ids) for f in frames[:-1]) == 5


def test_rpc_refuses_a_prompt_over_its_reservation_before_any_work_with_its_exact_count(
    url: str, engine: LLMEngine
) -> None:
    """The gateway reserved ``max_prompt_tokens``; the template and all count against it."""
    chat = {"messages": [{"role": "user", "content": "hello there"}], "sampling": {"max_tokens": 2}}
    exact = len(engine.tokenizer.encode_chat(chat["messages"]))  # type: ignore[arg-type]
    models = httpx.get(f"{url}/rpc/v1/models").json()["data"][0]
    assert models["prompt_overhead"] == len(engine.tokenizer.encode_chat([{"role": "user", "content": ""}]))
    assert 0 < models["prompt_overhead"] < exact
    body = chat | {"request_id": "over-1", "max_prompt_tokens": exact - 1}
    response = httpx.post(f"{url}/rpc/v1/generate", json=body, timeout=60)
    assert response.status_code == 412, response.text
    error = response.json()["error"]
    assert (error["code"], error["prompt_tokens"], error["param"]) == (
        "prompt_over_reservation",
        exact,
        "messages",
    )
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    frames = rpc_frames(url, chat | {"request_id": "over-2", "max_prompt_tokens": exact})
    assert isinstance(frames[-1], FinalFrame) and frames[-1].prompt_tokens == exact


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/chat/completions", b"{not json", 400, "parse the JSON"),
        ("/v1/chat/completions", b'{"model": "tiny"}', 400, "messages"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "bogus": 1}', 400, "bogus"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": 9}', 400, "temperature"),
        ("/v1/completions", b'{"model": "other", "prompt": "x"}', 404, "does not exist"),
        (
            "/v1/completions",
            json.dumps({"model": "tiny", "prompt": "y" * 200}).encode(),
            400,
            "context length",
        ),
        ("/rpc/v1/generate", b'{"request_id": "x"}', 400, "messages"),
        ("/rpc/v1/generate", b"[]", 400, ""),
        ("/rpc/v1/abort", b"{}", 400, "request_id"),
    ],
)
def test_bad_requests_get_openai_errors(url: str, path: str, body: bytes, status: int, fragment: str) -> None:
    response = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"]


def test_unknown_route_is_an_openai_404(url: str) -> None:
    response = httpx.get(f"{url}/v1/nothing")
    assert response.status_code == 404 and "message" in response.json()["error"]


def test_rpc_abort_ends_the_stream_and_frees_blocks(url: str, engine: LLMEngine) -> None:
    body = {"request_id": "to-abort", "prompt": "abc", "sampling": {"max_tokens": 120, "ignore_eos": True}}
    with httpx.stream("POST", f"{url}/rpc/v1/generate", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert isinstance(parse_frame(next(lines)), DeltaFrame)
        assert httpx.post(f"{url}/rpc/v1/abort", json={"request_id": "to-abort"}).json() == {"aborted": True}
        frames = [parse_frame(line) for line in lines if line]
    assert isinstance(frames[-1], FinalFrame) and frames[-1].finish_reason == "abort"
    assert frames[-1].completion_tokens < 120
    assert wait_until(lambda: blocks_held_by_requests(engine) == 0)
    assert httpx.post(f"{url}/rpc/v1/abort", json={"request_id": "to-abort"}).json() == {"aborted": False}


@contextmanager
def engine_paused_after_first_output(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Hold the step loop after the first step with outputs until the block exits: the tiny model
    would otherwise finish 120 tokens before a busy test thread gets to disconnect mid-stream."""
    produced, release = threading.Event(), threading.Event()
    step = engine.step

    def gated_step() -> list:
        if produced.is_set():
            release.wait(30)
        outputs = step()
        if outputs:
            produced.set()
        return outputs

    monkeypatch.setattr(engine, "step", gated_step)
    try:
        yield
    finally:
        release.set()


def aborted(engine: LLMEngine) -> float:
    return engine.metrics.requests_finished.labels(finish_reason="abort")._value.get()


@pytest.mark.parametrize("path", ["/rpc/v1/generate", "/v1/completions"])
def test_client_disconnect_mid_stream_frees_blocks(
    url: str, engine: LLMEngine, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if path == "/rpc/v1/generate":
        body = {"request_id": "gone", "prompt": "abc", "sampling": {"max_tokens": 120, "temperature": 0}}
    else:  # greedy: the tiny model's printable tokens always beat eos
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 120, "stream": True, "temperature": 0}
    aborted_before = aborted(engine)
    with engine_paused_after_first_output(engine, monkeypatch):
        with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as response:
            next(response.iter_lines())
            assert blocks_held_by_requests(engine) > 0  # mid-stream: the engine is held
    assert wait_until(lambda: blocks_held_by_requests(engine) == 0)
    assert wait_until(lambda: not engine.has_unfinished_requests())
    assert aborted(engine) == aborted_before + 1  # ended by the disconnect, not by max_tokens


def test_client_timeout_on_a_whole_response_frees_blocks(url: str, engine: LLMEngine) -> None:
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 120, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # 120 steps take far longer than 50 ms
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.05))
    assert wait_until(lambda: not engine.has_unfinished_requests())
    assert blocks_held_by_requests(engine) == 0


def test_metrics_expose_queues_blocks_tokens_and_latencies(url: str, client: openai.OpenAI) -> None:
    client.completions.create(model="tiny", prompt="metrics", max_tokens=3)
    text = httpx.get(f"{url}/metrics").text
    for name in (
        "tern_engine_requests_running",
        "tern_engine_requests_waiting",
        "tern_engine_kv_blocks_used",
        "tern_engine_kv_blocks_free",
        "tern_engine_prompt_tokens_total",
        "tern_engine_generation_tokens_total",
        "tern_engine_time_to_first_token_seconds_bucket",
        "tern_engine_inter_token_latency_seconds_bucket",
    ):
        assert name in text
    generated = next(
        line for line in text.splitlines() if line.startswith("tern_engine_generation_tokens_total")
    )
    assert float(generated.split()[-1]) >= 3


@pytest.mark.slow
def test_default_model_streams_utf8_safely_and_knows_paris(default_model: LoadedModel) -> None:
    """The real SmolLM2: an emoji split over several byte tokens never streams half a character."""
    from engine.config import EngineConfig

    engine = LLMEngine(
        EngineConfig(device="cpu", kv_cache_gib=0.05),
        model=default_model.model,
        tokenizer=default_model.tokenizer,
        model_config=default_model.config,
        model_name=default_model.name,
    )
    server = ServerThread(create_app(engine)).start()
    try:
        frames = rpc_frames(
            server.url,
            {
                "request_id": "emoji",
                "prompt": "Emoji list: 😀 😃 😄 😁",
                "sampling": {"max_tokens": 8, "temperature": 0},
            },
        )
        deltas = [f for f in frames if isinstance(f, DeltaFrame)]
        tokens = [t for f in deltas for t in f.token_ids]
        text = "".join(f.text for f in deltas)
        assert any(ord(ch) > 0xFFFF for ch in text)  # an emoji made it out whole...
        assert any(f.token_ids and not f.text for f in deltas)  # ...after being held back mid-character
        assert "\ufffd" not in text
        assert text == default_model.tokenizer.decode(tokens)

        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(
            model=default_model.name,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20,
            temperature=0,
        )
        assert "Paris" in answer.choices[0].message.content
    finally:
        server.stop()
