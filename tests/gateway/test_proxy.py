"""The /v1 surface through the app (real Postgres and Redis) to a fake engine over real HTTP: what a
good request gets, and what reaches the engine.

Refusals and engine failures: test_proxy_refusals.py. Streaming and disconnects need a real socket on
the client side too: see test_proxy_streaming.py. Fixtures ``key`` and ``outcomes``: conftest.py.
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
from proxy_checks import CHAT, assert_openai_error

from gateway.logging import JsonFormatter
from gateway.proxy.outcome import RelayOutcome
from gateway.wiring import gateway_state

pytestmark = [pytest.mark.anyio, pytest.mark.fake_engines(count=2)]


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
