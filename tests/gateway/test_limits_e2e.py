"""Limits through real gateways in front of the stand-in engine: exact across two processes,
rate-limit headers on proxied responses, tenant-wide limits, token and spend budgets (seeded from
Postgres when Redis has lost its counters)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable

import httpx
import pytest
from credentials import bearer
from fake_engine import REPLY, FakeEngine

from gateway.config import Settings
from gateway.wiring import gateway_state

pytestmark = [pytest.mark.anyio, pytest.mark.fake_engines]

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "say hello"}], "max_tokens": 50}
PROMPT_TOKENS = 2  # the fake engine counts words
TOKENS_PER_REQUEST = PROMPT_TOKENS + len(REPLY)
SMALL_CHAT = {**CHAT, "max_tokens": len(REPLY)}
SMALL_WORST_CASE = 3 + 4 + len(REPLY)
"""What a budget reserves for SMALL_CHAT: 9 prompt bytes at 4 a token, 4 for its message, max_tokens."""


async def test_two_gateway_processes_admit_exactly_the_limit(
    gateway_processes: Callable[..., list[str]], gateway_settings: Settings, tmp_path
) -> None:
    """1,000 concurrent requests split over 2 gateways against a key allowed 100 per minute."""
    urls = gateway_processes(2, TERN_USAGE_SPOOL_DIR=str(tmp_path / "spool"))  # started concurrently
    admin = bearer(gateway_settings.admin_key.get_secret_value())  # type: ignore[union-attr]
    async with httpx.AsyncClient(base_url=urls[0], timeout=60, headers=admin) as http:
        tenant = (await http.post("/admin/tenants", json={"name": "replicas"})).json()
        body = {"tenant_id": tenant["id"], "name": "k", "kind": "inference", "rpm_limit": 100}
        key = (await http.post("/admin/keys", json=body)).json()["key"]

    limits = httpx.Limits(max_connections=500)
    clients = [httpx.AsyncClient(base_url=u, timeout=120, headers=bearer(key), limits=limits) for u in urls]
    try:
        body = CHAT | {"max_tokens": 1}
        responses = await asyncio.gather(
            *(clients[i % 2].post("/v1/chat/completions", json=body) for i in range(1000))
        )
    finally:
        for c in clients:
            await c.aclose()
    statuses = Counter(r.status_code for r in responses)
    assert set(statuses) <= {200, 429}, statuses
    assert abs(statuses[200] - 100) <= 1, statuses
    denied = next(r for r in responses if r.status_code == 429)
    assert denied.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(denied.headers["retry-after"]) >= 1


async def test_proxied_responses_carry_rate_limit_headers(
    client: httpx.AsyncClient, create_tenant_and_key
) -> None:
    _, key, _ = await create_tenant_and_key(rpm_limit=5, tpm_limit=10_000)
    first = await client.post("/v1/chat/completions", json=CHAT, headers=bearer(key))
    second = await client.post("/v1/chat/completions", json=CHAT, headers=bearer(key))
    assert first.status_code == second.status_code == 200, first.text
    assert first.headers["x-ratelimit-limit-requests"] == "5"
    assert first.headers["x-ratelimit-remaining-requests"] == "4"
    assert second.headers["x-ratelimit-remaining-requests"] == "3"
    assert first.headers["x-ratelimit-limit-tokens"] == "10000"
    # The second request's remaining tokens reflect the first one's real usage, not its reservation.
    reserved = int(first.headers["x-ratelimit-limit-tokens"]) - int(
        first.headers["x-ratelimit-remaining-tokens"]
    )
    assert reserved > TOKENS_PER_REQUEST
    remaining_after_second = 10_000 - TOKENS_PER_REQUEST - reserved
    assert second.headers["x-ratelimit-remaining-tokens"] == str(remaining_after_second)
    assert first.headers["x-ratelimit-reset-requests"]


async def test_tenant_limit_spans_the_tenants_keys(
    client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key
) -> None:
    tenant, key_a, _ = await create_tenant_and_key()
    created = await client.post(
        "/admin/keys",
        json={"tenant_id": tenant["id"], "name": "b", "kind": "inference"},
        headers=admin_headers,
    )
    key_b = created.json()["key"]
    put = await client.put(
        f"/admin/limits/tenants/{tenant['id']}", json={"rpm_limit": 1}, headers=admin_headers
    )
    assert put.status_code == 200, put.text
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=bearer(key_a))).status_code == 200
    denied = await client.post("/v1/chat/completions", json=CHAT, headers=bearer(key_b))
    assert denied.status_code == 429 and "this tenant" in denied.json()["error"]["message"]


async def test_tenant_admin_cannot_raise_limits(
    client: httpx.AsyncClient, admin_headers, create_tenant_and_key
) -> None:
    tenant, _, _ = await create_tenant_and_key()
    created = await client.post(
        "/admin/keys", json={"tenant_id": tenant["id"], "name": "adm", "kind": "admin"}, headers=admin_headers
    )
    tenant_admin = bearer(created.json()["key"])
    put = await client.put(
        f"/admin/limits/tenants/{tenant['id']}", json={"rpm_limit": 10**6}, headers=tenant_admin
    )
    assert put.status_code == 403
    got = await client.get(f"/admin/limits/tenants/{tenant['id']}", headers=tenant_admin)
    assert got.status_code == 200 and got.json()["rpm_limit"] is None


async def wait_for_usage_rows(app, n: int) -> None:  # type: ignore[no-untyped-def]
    recorder = gateway_state(app).usage_recorder
    deadline = time.monotonic() + 30
    while recorder.flushed < n:
        assert time.monotonic() < deadline, "usage never reached Postgres"
        await asyncio.sleep(0.05)


async def test_monthly_token_budget_stops_requests_and_survives_redis_loss(
    app, client: httpx.AsyncClient, create_tenant_and_key, fake_engine: FakeEngine, redis_url: str
) -> None:
    # Strict: the second request is admitted only because the first settled below its worst case.
    _, key, _ = await create_tenant_and_key(monthly_token_budget=TOKENS_PER_REQUEST + SMALL_WORST_CASE)
    for _ in range(2):
        ok = await client.post("/v1/chat/completions", json=SMALL_CHAT, headers=bearer(key))
        assert ok.status_code == 200
    assert ok.headers["x-tern-budget-remaining-tokens"] == "0"
    served = len(fake_engine.received)
    denied = await client.post("/v1/chat/completions", json=SMALL_CHAT, headers=bearer(key))
    assert denied.status_code == 429
    error = denied.json()["error"]
    assert error["code"] == "insufficient_quota" and "monthly token budget" in error["message"]
    assert int(denied.headers["retry-after"]) > 0
    assert len(fake_engine.received) == served  # refused before any engine work

    # Redis loses everything (restart without persistence): the budget is re-read from Postgres.
    await wait_for_usage_rows(app, 2)
    await gateway_state(app).limits_redis.flushall()
    again = await client.post("/v1/chat/completions", json=SMALL_CHAT, headers=bearer(key))
    assert again.status_code == 429 and again.json()["error"]["code"] == "insufficient_quota"


async def test_monthly_spend_budget_with_402(
    app, client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key
) -> None:
    assert gateway_state(app).request_limiter.limiter.settings.spend_budget_status == 402  # the default
    price = {"model": "fake-model", "prompt_per_mtok": "1000", "completion_per_mtok": "2000"}
    assert (await client.post("/admin/prices", json=price, headers=admin_headers)).status_code == 201
    _, key, key_id = await create_tenant_and_key()
    # A request costs 0.014 (2 prompt tokens, 6 completion tokens) and reserves 0.019 (7 and 6).
    put = await client.put(
        f"/admin/limits/keys/{key_id}", json={"monthly_spend_budget": "0.035"}, headers=admin_headers
    )
    assert put.status_code == 200, put.text
    for _ in range(2):
        ok = await client.post("/v1/chat/completions", json=SMALL_CHAT, headers=bearer(key))
        assert ok.status_code == 200
    assert ok.headers["x-tern-budget-remaining-spend"] == "0.002"  # 0.035 - 0.014 - 0.019 (its own)
    denied = await client.post("/v1/chat/completions", json=SMALL_CHAT, headers=bearer(key))
    assert denied.status_code == 402
    assert "monthly spend budget" in denied.json()["error"]["message"]


def metric(text: str, name: str, **labels: str) -> float:
    """A sample's value in the exposition text (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_operator_metrics_tokens_refusals_usage_queue_and_engine_health(
    app, client: httpx.AsyncClient, create_tenant_and_key, fake_engine: FakeEngine
) -> None:
    """The metrics operations.md promises (issue 18): tokens by tenant and model, refusals by limit,
    the usage buffer, and each engine's health."""
    tenant, key, _ = await create_tenant_and_key(rpm_limit=1)
    before = (await client.get("/metrics")).text
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=bearer(key))).status_code == 200
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=bearer(key))).status_code == 429
    await wait_for_usage_rows(app, 1)
    after = (await client.get("/metrics")).text
    tokens = {"tenant": tenant["id"], "model": "fake-model"}
    assert metric(after, "tern_tokens_total", **tokens, kind="completion") == len(REPLY)
    assert metric(after, "tern_tokens_total", **tokens, kind="prompt") == PROMPT_TOKENS
    refused = metric(after, "tern_limit_refusals_total", limit="rpm") - metric(
        before, "tern_limit_refusals_total", limit="rpm"
    )
    assert refused == 1
    assert metric(after, "tern_usage_queue_records") == 0  # flushed
    assert metric(after, "tern_engine_healthy", engine=fake_engine.url) == 1
