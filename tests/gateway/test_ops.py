"""Operations: request ids, liveness, readiness, Prometheus metrics, JSON access logs."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from fastapi import FastAPI

from gateway.logging import JsonFormatter
from gateway.wiring import gateway_state

pytestmark = pytest.mark.anyio


async def test_every_response_carries_a_request_id(
    client: httpx.AsyncClient, admin_headers: dict[str, str]
) -> None:
    ids = set()
    for path, headers in [
        ("/healthz", {}),
        ("/admin/tenants", {}),
        ("/nope", {}),
        ("/admin/tenants", admin_headers),
    ]:
        response = await client.get(path, headers=headers)
        assert response.headers["x-request-id"]
        ids.add(response.headers["x-request-id"])
    assert len(ids) == 4

    # A caller's id is never adopted (it would key the engine RPC and the usage row).
    same = [await client.get("/healthz", headers={"x-request-id": "trace-abc.123"}) for _ in range(2)]
    assert "trace-abc.123" not in {r.headers["x-request-id"] for r in same}
    assert same[0].headers["x-request-id"] != same[1].headers["x-request-id"]


async def test_unknown_route_is_openai_shaped_404(client: httpx.AsyncClient) -> None:
    response = await client.get("/no/such/route")
    assert response.status_code == 404 and set(response.json()["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }


async def test_healthz(client: httpx.AsyncClient) -> None:
    response = await client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


class FakePool:
    def __init__(self, healthy: bool) -> None:
        self.healthy = healthy

    async def any_healthy(self) -> bool:
        return self.healthy


async def test_readyz_needs_database_redis_and_an_engine(app: FastAPI, client: httpx.AsyncClient) -> None:
    state = gateway_state(app)
    original = state.engine_pool
    try:
        state.engine_pool = FakePool(healthy=False)  # type: ignore[assignment]  # only any_healthy() is asked
        response = await client.get("/readyz")
        assert response.status_code == 503
        assert response.json()["checks"] == {"database": True, "redis": True, "engine": False}
        assert "engine" in response.json()["error"]["message"]

        state.engine_pool = FakePool(healthy=True)  # type: ignore[assignment]
        response = await client.get("/readyz")
        assert response.status_code == 200 and response.json()["status"] == "ready"

        await state.redis.aclose()
        state.redis = type(state.redis).from_url("redis://127.0.0.1:1/0")  # nothing listens there
        response = await client.get("/readyz")
        assert response.status_code == 503 and response.json()["checks"]["redis"] is False
    finally:
        state.engine_pool = original


async def test_metrics_count_requests_by_route_template_and_status(
    client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key
) -> None:
    _, _, key_id = await create_tenant_and_key()
    await client.get(f"/admin/keys/{key_id}", headers=admin_headers)
    await client.get(f"/admin/keys/{key_id}", headers={"Authorization": "Bearer nope"})
    text = (await client.get("/metrics")).text
    assert 'tern_http_requests_total{method="GET",route="/admin/keys/{key_id}",status="200"}' in text
    assert 'tern_http_requests_total{method="GET",route="/admin/keys/{key_id}",status="401"}' in text
    assert (
        'tern_http_request_duration_seconds_bucket{le="0.005",method="GET",route="/admin/keys/{key_id}"}'
        in text
    )
    assert key_id not in text  # raw paths never become labels


async def test_access_log_is_one_json_line_with_the_request_id(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="tern.access"):
        response = await client.get("/healthz", headers={"x-request-id": "log-me-123"})
    records = [r for r in caplog.records if r.name == "tern.access"]
    assert len(records) == 1
    line = json.loads(JsonFormatter().format(records[0]))
    assert line["request_id"] == response.headers["x-request-id"] != "log-me-123"
    assert line["client_request_id"] == "log-me-123"  # the caller's id, logged for correlation only
    assert line["route"] == "/healthz" and line["status"] == 200 and line["duration_ms"] >= 0


def test_json_logs_carry_no_ansi_colour_codes() -> None:
    """Issue 18: uvicorn attaches a coloured copy of its messages (``color_message``) for terminals."""
    record = logging.LogRecord(
        "uvicorn.error", logging.INFO, "", 0, "Started server process [%d]", (42,), None
    )
    record.color_message = "Started server process [\x1b[36m%d\x1b[0m]"
    line = JsonFormatter().format(record)
    assert "\\u001b" not in line and "\x1b" not in line
    assert json.loads(line)["msg"] == "Started server process [42]"


def test_json_log_timestamps_are_utc_milliseconds_across_seconds() -> None:
    """The formatter reuses the last second's text: a record in another second must not get it."""
    formatter = JsonFormatter()
    stamps = []
    for created in (1_764_297_599.25, 1_764_297_599.999, 1_764_297_600.0, 1_700_000_000.5, 1_764_297_599.5):
        record = logging.LogRecord("tern.access", logging.INFO, "", 0, "request", None, None)
        record.created, record.msecs = created, int((created - int(created)) * 1000)
        stamps.append(json.loads(formatter.format(record))["ts"])
    assert stamps == [
        "2025-11-28T02:39:59.250+00:00",
        "2025-11-28T02:39:59.999+00:00",
        "2025-11-28T02:40:00.000+00:00",
        "2023-11-14T22:13:20.500+00:00",
        "2025-11-28T02:39:59.500+00:00",
    ]
