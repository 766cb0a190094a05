"""The /v1 surface through the app (real Postgres and Redis) to a fake engine over real HTTP.

Streaming and disconnects need a real socket on the client side too: see test_proxy_streaming.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest
from credentials import CreateTenantAndKey, bearer
from fake_engine import REPLY, FakeEngine
from fastapi import FastAPI
from sqlalchemy import text

from gateway.logging import JsonFormatter
from gateway.proxy.outcome import RelayOutcome
from gateway.wiring import gateway_state

pytestmark = [pytest.mark.anyio, pytest.mark.fake_engines(count=2)]

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "say hello"}]}


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


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["x-request-id"]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return error


async def set_healthy(app: FastAPI, engine: FakeEngine, healthy: bool) -> None:
    engine.healthy = healthy
    await gateway_state(app).engine_pool.probe_all()


async def test_chat_completion_non_streaming(
    client: httpx.AsyncClient, key: dict[str, str], outcomes: list[RelayOutcome]
) -> None:
    response = await client.post("/v1/chat/completions", json=CHAT | {"max_tokens": 2}, headers=key)
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body["id"] == f"chatcmpl-{request_id}" and body["object"] == "chat.completion"
    assert body["model"] == "fake-model"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello from"},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 2,
        "total_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    [outcome] = outcomes
    assert (outcome.request_id, outcome.status, outcome.finish_reason) == (request_id, 200, "length")
    assert (outcome.prompt_tokens, outcome.completion_tokens, outcome.usage_exact) == (2, 2, True)
    assert outcome.endpoint == "chat.completions" and not outcome.stream and outcome.ttft_s is not None


async def test_request_reaches_engine_as_rpc(
    client: httpx.AsyncClient, key: dict[str, str], fake_engines: list[FakeEngine]
) -> None:
    body = CHAT | {"temperature": 0, "stop": "x", "seed": 7, "top_k": 5, "user": "ignored"}
    response = await client.post("/v1/chat/completions", json=body, headers=key)
    assert response.status_code == 200, response.text
    [sent] = [r for e in fake_engines for r in e.received]
    assert sent.request_id == response.headers["x-request-id"]
    assert (sent.sampling.temperature, sent.sampling.stop, sent.sampling.seed, sent.sampling.top_k) == (
        0,
        ["x"],
        7,
        5,
    )
    # TERN_PREFIX_CACHE_ISOLATION=tenant, the default: the tenant id (a UUID) is the namespace.
    assert sent.cache_namespace is not None and len(sent.cache_namespace) == 36


async def test_structured_output_and_tools_reach_the_engine_and_bad_ones_do_not(
    client: httpx.AsyncClient, key: dict[str, str], fake_engines: list[FakeEngine]
) -> None:
    """Issue 15: the gateway validates these fields as OpenAI does and passes them on unchanged."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": schema}}
    body = CHAT | {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": schema, "strict": True},
        },
        "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
    }
    response = await client.post("/v1/chat/completions", json=body, headers=key)
    assert response.status_code == 200, response.text
    [sent] = [r for e in fake_engines for r in e.received]
    assert sent.json_schema == schema and sent.parallel_tool_calls is False
    assert sent.tools is not None and sent.tools[0].model_dump(exclude_none=True) == tool
    assert not isinstance(sent.tool_choice, str) and sent.tool_choice.function.name == "get_weather"

    for bad, param in [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ]:
        refused = await client.post("/v1/chat/completions", json=CHAT | bad, headers=key)
        assert assert_openai_error(refused, 400)["param"] == param
    assert len([r for e in fake_engines for r in e.received]) == 1  # refused ones never reach an engine


async def test_default_max_tokens_is_the_cap(
    app: FastAPI, client: httpx.AsyncClient, key: dict[str, str], fake_engines: list[FakeEngine]
) -> None:
    """TERN_LIMITS_DEFAULT_MAX_TOKENS is what a request without max_tokens gets and the most any gets:
    one without ran 5,251 tokens until its client gave up (issue 18, defect 8)."""
    cap = gateway_state(app).request_limiter.limiter.settings.default_max_tokens
    for extra, expected in (({}, cap), ({"max_tokens": cap + 1000}, cap), ({"max_tokens": 3}, 3)):
        response = await client.post("/v1/chat/completions", json=CHAT | extra, headers=key)
        assert response.status_code == 200, response.text
        [sent] = [
            r for e in fake_engines for r in e.received if r.request_id == response.headers["x-request-id"]
        ]
        assert sent.sampling.max_tokens == expected


async def test_max_tokens_cap_per_tenant_and_per_key(
    client: httpx.AsyncClient,
    admin_headers: dict[str, str],
    create_tenant_and_key: CreateTenantAndKey,
    fake_engines: list[FakeEngine],
) -> None:
    """The cap is overridable: the key's max_tokens wins over its tenant's, which wins over the default."""
    tenant, secret, key_id = await create_tenant_and_key()

    async def sent_max_tokens(**extra: Any) -> int | None:
        response = await client.post("/v1/chat/completions", json=CHAT | extra, headers=bearer(secret))
        assert response.status_code == 200, response.text
        request_id = response.headers["x-request-id"]
        [sent] = [r for e in fake_engines for r in e.received if r.request_id == request_id]
        return sent.sampling.max_tokens

    put = await client.put(
        f"/admin/limits/tenants/{tenant['id']}", json={"max_tokens": 64}, headers=admin_headers
    )
    assert put.status_code == 200 and put.json()["max_tokens"] == 64
    assert await sent_max_tokens() == 64 and await sent_max_tokens(max_tokens=500) == 64
    put = await client.put(f"/admin/limits/keys/{key_id}", json={"max_tokens": 16}, headers=admin_headers)
    assert put.status_code == 200
    assert await sent_max_tokens() == 16 and await sent_max_tokens(max_tokens=8) == 8


@pytest.mark.parametrize("isolation", ["shared", "tenant"])
async def test_prefix_cache_is_shared_or_isolated_per_tenant(
    app: FastAPI,
    client: httpx.AsyncClient,
    create_tenant_and_key: CreateTenantAndKey,
    fake_engines: list[FakeEngine],
    isolation: str,
) -> None:
    """The RPC cache_namespace: none when tenants share the engines' prefix cache, else the tenant."""
    app.state.settings.prefix_cache_isolation = isolation
    namespaces = {}
    for _ in range(2):
        tenant, secret, _ = await create_tenant_and_key()
        response = await client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
        assert response.status_code == 200, response.text
        [sent] = [
            r for e in fake_engines for r in e.received if r.request_id == response.headers["x-request-id"]
        ]
        namespaces[tenant["id"]] = sent.cache_namespace
    if isolation == "shared":
        assert list(namespaces.values()) == [None, None]
    else:
        assert all(namespace == tenant_id for tenant_id, namespace in namespaces.items())


async def test_caller_request_ids_never_key_the_engine_or_usage(
    client: httpx.AsyncClient,
    key: dict[str, str],
    fake_engines: list[FakeEngine],
    outcomes: list[RelayOutcome],
) -> None:
    """Two concurrent requests sending the same x-request-id stay two requests with their own ids."""
    same = key | {"x-request-id": "client-chosen"}
    responses = await asyncio.gather(
        *(client.post("/v1/chat/completions", json=CHAT, headers=same) for _ in range(2))
    )
    assert [r.status_code for r in responses] == [200, 200]
    ids = {r.headers["x-request-id"] for r in responses}
    assert len(ids) == 2 and "client-chosen" not in ids
    assert {r.request_id for e in fake_engines for r in e.received} == ids
    assert {o.request_id for o in outcomes} == ids


async def test_text_completion_non_streaming(client: httpx.AsyncClient, key: dict[str, str]) -> None:
    response = await client.post(
        "/v1/completions", json={"model": "fake-model", "prompt": "a b c"}, headers=key
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "".join(REPLY)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == len(REPLY)


@pytest.mark.parametrize(
    ("content", "param", "fragment"),
    [
        (b'{"model": "fake-model", "messages": [', None, "valid JSON"),
        (b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "foo": 1}', "foo", "foo"),
        (b'{"model": "fake-model"}', "messages", "messages"),
        (b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "n": 99}', "n", "n"),
        (b'"just a string"', None, "JSON object"),
    ],
)
async def test_bad_input_is_an_openai_shaped_400(
    client: httpx.AsyncClient,
    key: dict[str, str],
    fake_engines: list[FakeEngine],
    content: bytes,
    param: str | None,
    fragment: str,
) -> None:
    response = await client.post(
        "/v1/chat/completions", content=content, headers=key | {"content-type": "application/json"}
    )
    error = assert_openai_error(response, 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert fragment in error["message"]
    assert not any(e.received for e in fake_engines)


async def test_oversize_body_is_413(
    client: httpx.AsyncClient, key: dict[str, str], app: FastAPI, fake_engines: list[FakeEngine]
) -> None:
    limit = app.state.settings.max_body_bytes
    big = CHAT | {"messages": [{"role": "user", "content": "x" * (limit + 1)}]}
    assert_openai_error(await client.post("/v1/chat/completions", json=big, headers=key), 413)

    async def chunks() -> Any:  # no content-length: the limit applies while reading
        yield b'{"model": "fake-model", "prompt": "'
        for _ in range(limit // 65536 + 2):
            yield b"x" * 65536
        yield b'"}'

    response = await client.post("/v1/completions", content=chunks(), headers=key)
    assert_openai_error(response, 413)
    assert not any(e.received for e in fake_engines)


async def test_model_not_allowed_for_key_is_403(
    client: httpx.AsyncClient, create_tenant_and_key: CreateTenantAndKey, fake_engines: list[FakeEngine]
) -> None:
    _, secret, _ = await create_tenant_and_key(models=["some-other-model"])
    response = await client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    error = assert_openai_error(response, 403, "model_not_allowed")
    assert error["param"] == "model"
    assert not any(e.received for e in fake_engines)


async def test_unknown_model_is_404_and_not_billed(
    app: FastAPI, client: httpx.AsyncClient, create_tenant_and_key: CreateTenantAndKey
) -> None:
    """Only requests that reached an engine are metered: otherwise any client could write usage rows,
    and model names of its choosing into its tenant's reports (issue 18, defect 3)."""
    _, secret, key_id = await create_tenant_and_key()
    response = await client.post(
        "/v1/chat/completions", json=CHAT | {"model": "gpt-4o"}, headers=bearer(secret)
    )
    assert_openai_error(response, 404, "model_not_found")
    served = await client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    assert served.status_code == 200
    recorder = gateway_state(app).usage_recorder
    deadline = asyncio.get_running_loop().time() + 30
    while recorder.flushed < 1:  # rows flush in arrival order: the 404's would be in this batch or before
        assert asyncio.get_running_loop().time() < deadline, "usage never reached Postgres"
        await asyncio.sleep(0.05)
    async with gateway_state(app).db_engine.connect() as conn:
        rows = await conn.execute(text("SELECT model FROM usage_records WHERE key_id = :k"), {"k": key_id})
        assert [model for (model,) in rows] == ["fake-model"]


async def test_models_are_filtered_by_the_key_scope(
    client: httpx.AsyncClient, key: dict[str, str], create_tenant_and_key: CreateTenantAndKey
) -> None:
    response = await client.get("/v1/models", headers=key)
    assert response.status_code == 200
    assert response.json()["object"] == "list"
    assert [m["id"] for m in response.json()["data"]] == ["fake-model"]
    _, scoped, _ = await create_tenant_and_key(models=["some-other-model"])
    response = await client.get("/v1/models", headers=bearer(scoped))
    assert response.json()["data"] == []


async def test_no_healthy_engine_is_503_and_not_ready(
    client: httpx.AsyncClient,
    key: dict[str, str],
    app: FastAPI,
    fake_engines: list[FakeEngine],
    outcomes: list[RelayOutcome],
) -> None:
    for engine in fake_engines:
        await set_healthy(app, engine, False)
    error = assert_openai_error(await client.post("/v1/chat/completions", json=CHAT, headers=key), 503)
    assert error["code"] == "engine_unavailable" and error["type"] == "server_error"
    assert outcomes[-1].status == 503 and outcomes[-1].completion_tokens == 0
    ready = await client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["engine"] is False

    await set_healthy(app, fake_engines[1], True)
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=key)).status_code == 200
    assert (await client.get("/readyz")).status_code == 200


async def test_unhealthy_engine_leaves_rotation_and_returns(
    client: httpx.AsyncClient, key: dict[str, str], app: FastAPI, fake_engines: list[FakeEngine]
) -> None:
    first, second = fake_engines
    await set_healthy(app, first, False)
    for _ in range(4):
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=key)).status_code == 200
    assert (len(first.received), len(second.received)) == (0, 4)

    await set_healthy(app, first, True)
    for _ in range(4):
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=key)).status_code == 200
    assert len(first.received) > 0


async def test_engine_that_went_away_is_skipped(
    client: httpx.AsyncClient, key: dict[str, str], app: FastAPI, fake_engines: list[FakeEngine]
) -> None:
    """A refused connection takes the engine out at once and the request goes to another one."""
    first, second = fake_engines
    first.stop()
    for _ in range(3):
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=key)).status_code == 200
    assert len(second.received) == 3
    assert [u.healthy for u in gateway_state(app).engine_pool.upstreams] == [False, True]
    assert [u.inflight for u in gateway_state(app).engine_pool.upstreams] == [0, 0]
    second.stop()
    assert_openai_error(await client.post("/v1/chat/completions", json=CHAT, headers=key), 503)


@pytest.mark.parametrize(
    ("mode", "status", "code"),
    [("context_length", 400, "context_length_exceeded"), ("error_status", 500, None)],
)
async def test_engine_refusals_are_relayed_with_their_status(
    client: httpx.AsyncClient,
    key: dict[str, str],
    fake_engines: list[FakeEngine],
    outcomes: list[RelayOutcome],
    mode: str,
    status: int,
    code: str | None,
) -> None:
    for engine in fake_engines:
        engine.mode = mode  # type: ignore[assignment]
    for stream in (False, True):
        response = await client.post("/v1/chat/completions", json=CHAT | {"stream": stream}, headers=key)
        assert_openai_error(response, status, code)
    assert [o.status for o in outcomes] == [status, status]


async def test_engine_error_mid_generation_non_streaming(
    client: httpx.AsyncClient,
    key: dict[str, str],
    fake_engines: list[FakeEngine],
    outcomes: list[RelayOutcome],
) -> None:
    for engine in fake_engines:
        engine.mode = "error_midstream"
    response = await client.post("/v1/chat/completions", json=CHAT, headers=key)
    assert_openai_error(response, 500, "engine_error")
    assert outcomes[0].completion_tokens == 2 and outcomes[0].finish_reason == "error"


async def test_refusals_on_the_proxy_route(
    client: httpx.AsyncClient,
    admin_headers: dict[str, str],
    create_tenant_and_key: CreateTenantAndKey,
    fake_engines: list[FakeEngine],
) -> None:
    assert_openai_error(await client.post("/v1/chat/completions", json=CHAT), 401)
    assert_openai_error(await client.post("/v1/chat/completions", json=CHAT, headers=admin_headers), 403)
    assert_openai_error(await client.get("/v1/models", headers=admin_headers), 403)

    tenant, secret, key_id = await create_tenant_and_key()
    revoked = await client.post(f"/admin/keys/{key_id}/revoke", headers=admin_headers)
    assert revoked.status_code == 200, revoked.text
    assert_openai_error(await client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret)), 401)

    tenant, secret, _ = await create_tenant_and_key()
    suspended = await client.patch(
        f"/admin/tenants/{tenant['id']}", json={"status": "suspended"}, headers=admin_headers
    )
    assert suspended.status_code == 200, suspended.text
    assert_openai_error(await client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret)), 403)
    assert not any(e.received for e in fake_engines)


async def test_upstream_latency_is_exported(
    client: httpx.AsyncClient, key: dict[str, str], fake_engines: list[FakeEngine]
) -> None:
    def samples(text: str, engine: FakeEngine) -> list[str]:
        return [
            line
            for line in text.splitlines()
            if line.startswith("tern_upstream_request_duration_seconds_count") and engine.url in line
        ]

    before = (await client.get("/metrics")).text
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=key)).status_code == 200
    after = (await client.get("/metrics")).text
    [engine] = [e for e in fake_engines if e.received]
    [line] = samples(after, engine)
    assert 'rpc="generate"' in line and 'outcome="ok"' in line
    previous = float(samples(before, engine)[0].split()[-1]) if samples(before, engine) else 0.0
    assert float(line.split()[-1]) == previous + 1


async def test_generation_routes_keep_the_request_envelope(
    client: httpx.AsyncClient,
    create_tenant_and_key: CreateTenantAndKey,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The generation routes skip FastAPI's routing (gateway.app.GatewayApp), not its envelope:
    access log and metrics by route template, with key and tenant; other methods are a 405."""
    tenant, secret, key_id = await create_tenant_and_key()
    with caplog.at_level(logging.INFO, logger="tern.access"):
        response = await client.post(
            "/v1/completions", json={"model": "fake-model", "prompt": "a b c"}, headers=bearer(secret)
        )
    assert response.status_code == 200, response.text
    [record] = [r for r in caplog.records if r.name == "tern.access"]
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == response.headers["x-request-id"]
    assert line["route"] == "/v1/completions" and line["status"] == 200
    assert line["key_id"] == key_id and line["tenant_id"] == tenant["id"]
    metrics = (await client.get("/metrics")).text
    assert 'tern_http_requests_total{method="POST",route="/v1/completions",status="200"}' in metrics

    error = assert_openai_error(await client.get("/v1/chat/completions", headers=bearer(secret)), 405)
    assert error["type"] == "invalid_request_error"


async def test_client_gone_mid_upload_is_logged_499_not_an_error(
    app: FastAPI,
    create_tenant_and_key: CreateTenantAndKey,
    fake_engines: list[FakeEngine],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client that disconnects before its body has arrived gets nothing sent, reaches no engine,
    and shows as 499 in the access log and the metrics, not as an unhandled 500."""
    _, secret, _ = await create_tenant_and_key()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"gateway"),
            (b"authorization", bearer(secret)["Authorization"].encode()),
            (b"content-type", b"application/json"),
            (b"content-length", b"1000"),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("gateway", 80),
    }
    messages = iter(
        [
            {"type": "http.request", "body": b'{"model": "fake-model", ', "more_body": True},
            {"type": "http.disconnect"},
        ]
    )
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return next(messages)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with caplog.at_level(logging.INFO):
        await app(scope, receive, send)
    assert sent == []
    assert not any(e.received for e in fake_engines)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    [record] = [r for r in caplog.records if r.name == "tern.access"]
    assert json.loads(JsonFormatter().format(record))["status"] == 499
