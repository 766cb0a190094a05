"""The /v1 surface refusing what it must, in OpenAI's error shape: bad input, oversize bodies, models a
key may not use, and engines that are unhealthy, gone, refusing or failing mid-generation.

Real Postgres and Redis, a fake engine over real HTTP. Fixtures ``key`` and ``outcomes``: conftest.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest
from credentials import CreateTenantAndKey, bearer
from fake_engine import FakeEngine
from fastapi import FastAPI
from proxy_checks import CHAT, assert_openai_error, set_healthy
from sqlalchemy import text

from gateway.logging import JsonFormatter
from gateway.proxy.outcome import RelayOutcome
from gateway.wiring import gateway_state

pytestmark = [pytest.mark.anyio, pytest.mark.fake_engines(count=2)]


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
