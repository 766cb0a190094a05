"""Budget alerts through the gateway: a real local HTTP receiver gets one webhook call per threshold
crossing, with a signature it can verify, retried while it fails; one audit row; the used-ratio gauge;
GET /admin/budgets; and a failed request's reservation given back."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from aiohttp import web
from credentials import bearer
from fake_engine import REPLY, FakeEngine

from gateway.budgets.alerts import AlertSettings
from gateway.wiring import gateway_state
from tern_stack.services import free_port

pytestmark = [pytest.mark.anyio, pytest.mark.fake_engines]

SECRET = "whsec-test-0123456789"
CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "say hello"}],
    "max_tokens": len(REPLY),
}
TOKENS_PER_REQUEST = 2 + len(REPLY)  # the fake engine counts prompt words


@dataclass
class Receiver:
    """A webhook receiver on a real port that answers 500 to its first ``failures`` calls."""

    failures: int
    calls: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.calls.append(({k.lower(): v for k, v in request.headers.items()}, await request.read()))
        if len(self.calls) <= self.failures:
            return web.Response(status=500, text="not now")
        return web.Response(status=204)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    hook = Receiver(failures=2)
    app = web.Application()
    app.router.add_post("/hook", hook.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    hook.url = f"http://127.0.0.1:{port}/hook"
    yield hook
    await runner.cleanup()


def verify(headers: dict[str, str], body: bytes) -> bool:
    """What a receiver does: recompute the HMAC over "<t>.<body>" and compare in constant time."""
    parts = dict(item.split("=", 1) for item in headers["x-tern-signature"].split(","))
    expected = hmac.new(SECRET.encode(), f"{parts['t']}.".encode() + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, parts["v1"])


async def test_one_signed_webhook_per_threshold_crossing_retried_while_the_receiver_fails(
    app: Any,
    client: httpx.AsyncClient,
    admin_headers: dict[str, str],
    create_tenant_and_key: Any,
    fake_engine: FakeEngine,
    receiver: Receiver,
) -> None:
    state = gateway_state(app)
    state.budget_alerts.settings = AlertSettings(
        webhook_url=receiver.url, webhook_secret=SECRET, webhook_backoff_s=0.05
    )
    tenant, key, key_id = await create_tenant_and_key()
    budget = {
        "tenant_id": tenant["id"],
        "key_id": key_id,
        "metric": "tokens",
        "period": "day",
        "amount": 10 * TOKENS_PER_REQUEST,
        "alert_ratio": 0.25,
    }
    created = await client.post("/admin/budgets", json=budget, headers=admin_headers)
    assert created.status_code == 201, created.text
    # 2 requests: 20% used, no alert; the 3rd crosses 25%; 4 more stay past it: no second alert.
    for _ in range(7):
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=bearer(key))).status_code == 200
    await state.request_limiter.limiter.drain_alerts()

    assert len(receiver.calls) == 3  # two 500s, then delivered; all the same event
    ids = {headers["x-tern-event-id"] for headers, _ in receiver.calls}
    assert len(ids) == 1
    for headers, body in receiver.calls:
        assert verify(headers, body)
        assert not verify({"x-tern-signature": headers["x-tern-signature"]}, body + b" ")
    event = json.loads(receiver.calls[-1][1])
    assert event["type"] == "budget.threshold_crossed"
    assert event["budget"]["id"] == created.json()["id"] and event["budget"]["key_id"] == key_id
    assert event["budget"]["used"] == str(3 * TOKENS_PER_REQUEST)
    assert event["budget"]["limit"] == str(10 * TOKENS_PER_REQUEST) and event["budget"]["period"] == "day"

    audit = await client.get("/admin/audit", params={"action": "budget.alert"}, headers=admin_headers)
    entries = [e for e in audit.json()["data"] if e["tenant_id"] == tenant["id"]]
    assert len(entries) == 1 and entries[0]["after"]["id"] == event["id"]

    metrics = (await client.get("/metrics")).text
    line = f'tern_budget_used_ratio{{scope="key:{key_id}:tokens:day"}} '
    assert any(
        m.startswith(line) and float(m.split()[-1]) == pytest.approx(0.7) for m in metrics.splitlines()
    )

    listed = await client.get("/admin/budgets", params={"tenant": tenant["id"]}, headers=admin_headers)
    [status] = listed.json()["data"]
    assert status["used"] == str(7 * TOKENS_PER_REQUEST) and status["reserved"] == "0"
    assert status["resets_at"] is not None


async def test_a_receiver_that_never_answers_2xx_gets_one_call_plus_the_retries(
    app: Any, receiver: Receiver
) -> None:
    receiver.failures = 100
    alerts = gateway_state(app).budget_alerts
    alerts.settings = AlertSettings(
        webhook_url=receiver.url, webhook_secret=SECRET, webhook_backoff_s=0.01, webhook_retries=3
    )
    assert not await alerts.deliver({"id": "e1", "type": "budget.threshold_crossed"})
    assert len(receiver.calls) == 4


@pytest.mark.fake_engines(mode="error_status")
async def test_a_failed_request_gives_its_reservation_back_and_costs_nothing(
    client: httpx.AsyncClient,
    admin_headers: dict[str, str],
    create_tenant_and_key: Any,
    fake_engine: FakeEngine,
) -> None:
    tenant, key, key_id = await create_tenant_and_key()
    budget = {
        "tenant_id": tenant["id"],
        "key_id": key_id,
        "metric": "tokens",
        "period": "week",
        "amount": 1000,
    }
    assert (await client.post("/admin/budgets", json=budget, headers=admin_headers)).status_code == 201
    for _ in range(3):
        failed = await client.post("/v1/chat/completions", json=CHAT, headers=bearer(key))
        assert failed.status_code >= 500 and fake_engine.received
    [status] = (
        await client.get("/admin/budgets", params={"tenant": tenant["id"]}, headers=admin_headers)
    ).json()["data"]
    assert (status["used"], status["reserved"]) == ("0", "0")


async def test_a_budget_deleted_and_created_again_in_its_period_counts_what_ran_meanwhile(
    app: Any,
    client: httpx.AsyncClient,
    admin_headers: dict[str, str],
    create_tenant_and_key: Any,
    fake_engine: FakeEngine,
) -> None:
    """While a scope has no budget of a period, settlements do not add to that period's counter: a
    budget created again in the same period must not start from the count it had when deleted."""
    recorder = gateway_state(app).usage_recorder
    tenant, key, key_id = await create_tenant_and_key()
    budget = {
        "tenant_id": tenant["id"],
        "key_id": key_id,
        "metric": "tokens",
        "period": "day",
        "amount": 1000,
    }

    async def chat_once() -> None:
        flushed = recorder.flushed
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=bearer(key))).status_code == 200
        deadline = time.monotonic() + 30
        while recorder.flushed <= flushed:  # the row is in Postgres before the budget is changed
            assert time.monotonic() < deadline, "usage never reached Postgres"
            await asyncio.sleep(0.05)

    created = await client.post("/admin/budgets", json=budget, headers=admin_headers)
    assert created.status_code == 201, created.text
    await chat_once()
    deleted = await client.delete(f"/admin/budgets/{created.json()['id']}", headers=admin_headers)
    assert deleted.status_code == 204
    for _ in range(2):
        await chat_once()
    assert (await client.post("/admin/budgets", json=budget, headers=admin_headers)).status_code == 201
    [status] = (
        await client.get("/admin/budgets", params={"tenant": tenant["id"]}, headers=admin_headers)
    ).json()["data"]
    assert status["used"] == str(3 * TOKENS_PER_REQUEST)
