"""The ``openai`` engine kind against a stand-in OpenAI-compatible server, through a real gateway.

The gateway runs under uvicorn on a real port, on the test database and Redis; usage is read back
from Postgres. The end-to-end version against Tern's real engine is tests/e2e/test_openai_upstream.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from credentials import TEST_ADMIN_KEY, TEST_SECRET
from fake_engine import FakeEngine
from fake_openai_engine import REPLY, FakeOpenAIEngine, prompt_words
from live_server import ServerThread, create_inference_key
from test_usage_e2e import wait_for_rows

from gateway.app import create_app
from gateway.config import EngineSpec, Settings, parse_engine_url
from gateway.proxy.token_count import TokenCounter, estimate_tokens
from gateway.wiring import gateway_state

SERVED = "served-name"
UPSTREAM_KEY = "upstream-secret-key"
CHAT = {"model": SERVED, "messages": [{"role": "user", "content": "say hello to me"}]}
COMPLETION = {"model": SERVED, "prompt": "once upon a time"}


def test_engine_kind_is_named_by_the_scheme_prefix() -> None:
    assert parse_engine_url("openai+http://10.0.0.7:8000/") == EngineSpec("openai", "http://10.0.0.7:8000")
    assert parse_engine_url("openai+https://h") == EngineSpec("openai", "https://h")
    assert parse_engine_url("tern+http://h:8100") == EngineSpec("tern", "http://h:8100")
    assert parse_engine_url("http://h:8100") == EngineSpec("tern", "http://h:8100")
    settings = Settings(engine_urls="openai+http://a:1, http://b:2")  # type: ignore[arg-type]
    assert [s.kind for s in settings.engine_specs()] == ["openai", "tern"]
    with pytest.raises(ValueError, match="TERN_ENGINE_URLS"):
        Settings(engine_urls=["grpc://a:1"])
    with pytest.raises(ValueError, match="same upstream name"):
        Settings(engine_model_map={"a": "x", "b": "x"})


class Gateway:
    def __init__(self, server: ServerThread, key: str, database_url: str) -> None:
        self.server, self.key, self.database_url = server, key, database_url
        self.http = httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {key}"})

    @property
    def pool(self) -> Any:
        return gateway_state(self.server.server.config.app).engine_pool

    def probe(self) -> None:
        self.server.call(self.pool.probe_all())


def start_gateway(database_url: str, redis_url: str, engine_urls: list[str], **settings: Any) -> Gateway:
    defaults: dict[str, Any] = {
        "engine_api_key": UPSTREAM_KEY,
        "engine_model_map": {SERVED: "upstream-model"},
        "engine_health_interval_s": 3600,  # the tests probe when they mean to
    }
    config = Settings(
        database_url=database_url,
        redis_url=redis_url,
        secret=TEST_SECRET,
        admin_key=TEST_ADMIN_KEY,
        engine_urls=engine_urls,
        log_level="WARNING",
        **(defaults | settings),
    )
    server = ServerThread(create_app(config)).start()
    key = create_inference_key(server.url, TEST_ADMIN_KEY, tpm_limit=1_000_000)
    return Gateway(server, key, database_url)


@pytest.fixture
def upstream() -> Iterator[FakeOpenAIEngine]:
    engine = FakeOpenAIEngine(require_key=UPSTREAM_KEY, gate=threading.Event()).start()
    engine.gate.set()  # type: ignore[union-attr]  # open unless a test closes it
    yield engine
    engine.stop()


@pytest.fixture
def gateway(upstream: FakeOpenAIEngine, database_url: str, redis_url: str) -> Iterator[Gateway]:
    gw = start_gateway(database_url, redis_url, [f"openai+{upstream.url}"])
    yield gw
    gw.http.close()
    gw.server.stop()


def sse_events(response: httpx.Response) -> list[Any]:
    return [
        json.loads(line.removeprefix("data: ")) if line != "data: [DONE]" else "[DONE]"
        for line in response.iter_lines()
        if line.startswith("data: ")
    ]


def test_models_are_discovered_under_their_served_names(gateway: Gateway) -> None:
    models = gateway.http.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [SERVED]


def test_chat_is_forwarded_renamed_capped_with_the_engine_key_and_billed_as_reported(
    gateway: Gateway, upstream: FakeOpenAIEngine
) -> None:
    upstream.cached_tokens = 2
    resp = gateway.http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 3, "user": "u-1"})
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["id"] == f"chatcmpl-{resp.headers['x-request-id']}"
    assert answer["model"] == SERVED
    assert answer["choices"][0]["message"]["content"] == "".join(REPLY[:3])
    [sent] = upstream.received
    assert sent["model"] == "upstream-model" and sent["max_tokens"] == 3 and sent["user"] == "u-1"
    assert upstream.headers[0]["authorization"] == f"Bearer {UPSTREAM_KEY}"  # never the client's key
    [row] = wait_for_rows(gateway.database_url, 1)
    assert (row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"]) == (4, 2, 3)
    assert row["model"] == SERVED and row["status"] == 200 and row["usage_estimated"] is False
    assert answer["usage"]["prompt_tokens"] == 4


def test_limits_reserve_a_prompt_bound_from_the_template_measured_once(
    database_url: str, redis_url: str
) -> None:
    """An engine that does not list its template's tokens is asked once (one empty message, one
    token); a key with a TPM limit then reserves the prompt's bound: its messages' JSON bytes plus that."""
    upstream = FakeOpenAIEngine(require_key=UPSTREAM_KEY, prompt_overhead=None).start()
    gw = start_gateway(database_url, redis_url, [f"openai+{upstream.url}"])
    try:
        gw.probe()
        assert upstream.received == [
            {"model": "upstream-model", "messages": [{"role": "user", "content": ""}], "max_tokens": 1}
        ]
        assert gw.pool.prompt_overhead(SERVED) == 0  # the stand-in counts words: none in an empty message
        resp = gw.http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 3})
        assert resp.status_code == 200, resp.text
        bound = len(orjson.dumps(CHAT["messages"][0]))
        assert int(resp.headers["x-ratelimit-remaining-tokens"]) == 1_000_000 - bound - 3
        assert len(upstream.received) == 2  # measured once, not per request or probe
    finally:
        gw.http.close()
        gw.server.stop()
        upstream.stop()


@pytest.mark.parametrize("client_wants_usage", [False, True])
def test_streams_ask_for_usage_and_relay_events_with_the_gateway_id(
    gateway: Gateway, upstream: FakeOpenAIEngine, client_wants_usage: bool
) -> None:
    body: dict[str, Any] = COMPLETION | {"stream": True}
    if client_wants_usage:
        body["stream_options"] = {"include_usage": True}
    with gateway.http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        events = sse_events(resp)
        request_id = resp.headers["x-request-id"]
    assert upstream.received[0]["stream_options"] == {"include_usage": True}
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {f"cmpl-{request_id}"} and {c["model"] for c in chunks} == {SERVED}
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "".join(REPLY)
    usage_events = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usage_events) == (1 if client_wants_usage else 0)
    [row] = wait_for_rows(gateway.database_url, 1)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt_words(COMPLETION), len(REPLY))
    if client_wants_usage:
        assert usage_events[0]["completion_tokens"] == len(REPLY)
    assert row["usage_estimated"] is False and row["finish_reason"] == "stop"


def test_an_engine_refusal_is_relayed_in_openai_shape_and_bills_nothing(
    gateway: Gateway, upstream: FakeOpenAIEngine
) -> None:
    resp = gateway.http.post("/v1/chat/completions", json=CHAT | {"model": "not-served"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    assert not upstream.received
    upstream.fail_with = 400
    resp = gateway.http.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 400
    assert resp.json()["error"] | {"param": None} == {
        "message": "The engine refuses.",
        "type": "invalid_request_error",
        "param": None,
        "code": "refused",
    }
    [row] = wait_for_rows(gateway.database_url, 1)
    assert (row["status"], row["prompt_tokens"], row["completion_tokens"]) == (400, 0, 0)
    assert row["usage_estimated"] is False


def test_client_disconnect_closes_the_upstream_stream_and_bills_what_passed_once(
    gateway: Gateway, upstream: FakeOpenAIEngine
) -> None:
    assert upstream.gate is not None
    upstream.gate.clear()
    with gateway.http.stream("POST", "/v1/chat/completions", json=CHAT | {"stream": True}) as resp:
        for line in resp.iter_lines():
            if '"content":"Hello"' in line:
                break  # the first word arrived; the upstream now waits at its gate
    assert upstream.finished.wait(30)
    assert upstream.closed_early == [1]
    [row] = wait_for_rows(gateway.database_url, 1)
    assert row["status"] == 499 and row["usage_estimated"] is True
    # No tokenizer configured: one token per content event, the prompt at 4 bytes a token.
    assert row["completion_tokens"] == 1
    assert row["prompt_tokens"] == estimate_tokens(CHAT["messages"][0]["content"])  # type: ignore[index]


def test_usage_an_engine_does_not_report_is_counted_with_the_tokenizer_and_marked(
    upstream: FakeOpenAIEngine, database_url: str, redis_url: str, tmp_path: Path
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {w: i for i, w in enumerate(["[UNK]", "Hello", "from", "the", "upstream", ".", "once", "upon"])}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    counter = TokenCounter({SERVED: str(tmp_path / "tokenizer.json")})
    assert counter.count(SERVED, "Hello from the upstream.") == 5

    upstream.report_usage = False
    gw = start_gateway(
        database_url,
        redis_url,
        [f"openai+{upstream.url}"],
        engine_tokenizers={SERVED: str(tmp_path / "tokenizer.json")},
    )
    try:
        assert gw.http.post("/v1/completions", json=COMPLETION).status_code == 200
        with gw.http.stream("POST", "/v1/completions", json=COMPLETION | {"stream": True}) as resp:
            assert sse_events(resp)[-1] == "[DONE]"
    finally:
        gw.http.close()
        gw.server.stop()
    rows = wait_for_rows(database_url, 2)
    assert [(r["prompt_tokens"], r["completion_tokens"], r["usage_estimated"]) for r in rows] == [
        (4, 5, True),
        (4, 5, True),
    ]


def test_health_rotation_and_a_server_without_a_health_route(
    upstream: FakeOpenAIEngine, database_url: str, redis_url: str
) -> None:
    other = FakeOpenAIEngine(health_status=None, require_key=UPSTREAM_KEY).start()
    tern = FakeEngine(model=SERVED).start()
    gw = start_gateway(database_url, redis_url, [f"openai+{upstream.url}", f"openai+{other.url}", tern.url])
    try:
        pool = gw.pool
        assert [(u.kind, u.healthy) for u in pool.upstreams] == [
            ("openai", True),
            ("openai", True),
            ("tern", True),
        ]
        upstream.health_status = 503
        gw.probe()
        assert [u.healthy for u in pool.upstreams] == [False, True, True]
        other.stop()
        gw.probe()
        assert [u.healthy for u in pool.upstreams] == [False, False, True]
        # Only the Tern engine is left: the same model is now served over the RPC.
        resp = gw.http.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 200 and tern.received
        upstream.health_status = 200
        gw.probe()
        assert pool.upstreams[0].healthy
        assert gw.http.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert upstream.received
    finally:
        gw.http.close()
        gw.server.stop()
        other.stop()
        tern.stop()


@pytest.mark.parametrize("report_usage", [True, False])
def test_responses_reach_an_openai_upstream_as_its_chat_and_are_billed_once(
    gateway: Gateway, upstream: FakeOpenAIEngine, report_usage: bool
) -> None:
    upstream.report_usage = report_usage
    client = openai.OpenAI(base_url=f"{gateway.server.url}/v1", api_key=gateway.key, max_retries=0)
    question = {"instructions": "Be brief.", "input": "say hello to me", "max_output_tokens": 20}
    reply = client.responses.create(model=SERVED, **question)
    assert reply.output_text == "".join(REPLY) and reply.status == "completed" and reply.model == SERVED
    events = list(client.responses.create(model=SERVED, stream=True, **question))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "".join(REPLY)
    plain, streamed = upstream.received
    assert plain["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "say hello to me"},
    ]
    assert plain["max_tokens"] == 20 and plain["model"] == "upstream-model"
    assert streamed["stream"] is True and streamed["stream_options"] == {"include_usage": True}
    final = events[-1].response  # type: ignore[union-attr]
    rows = wait_for_rows(gateway.database_url, 2)
    assert {r["endpoint"] for r in rows} == {"responses"} and all(
        r["usage_estimated"] != report_usage for r in rows
    )
    assert reply.usage is not None and final.usage is not None
    billed = sorted((r["prompt_tokens"], r["completion_tokens"]) for r in rows)
    assert billed == sorted((u.input_tokens, u.output_tokens) for u in (reply.usage, final.usage))
