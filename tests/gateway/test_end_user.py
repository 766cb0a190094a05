"""The OpenAI ``user`` field through the gateway: recorded on the usage row, reported by end user,
and bounded (a longer one is a 400 naming the parameter)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from credentials import bearer
from fake_engine import FakeEngine
from sqlalchemy import text

from gateway.wiring import gateway_state

pytestmark = [pytest.mark.anyio, pytest.mark.fake_engines]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "say hello"}], **fields}


async def test_the_user_field_is_recorded_and_reported(
    app: Any,
    client: httpx.AsyncClient,
    admin_headers: dict[str, str],
    create_tenant_and_key: Any,
    fake_engine: FakeEngine,
) -> None:
    tenant, key, _ = await create_tenant_and_key()
    for user in ("customer-42", "customer-42", None):
        body = chat() if user is None else chat(user=user)
        assert (await client.post("/v1/chat/completions", json=body, headers=bearer(key))).status_code == 200
    stream = chat(user="customer-7", stream=True)
    assert (await client.post("/v1/chat/completions", json=stream, headers=bearer(key))).status_code == 200

    recorder = gateway_state(app).usage_recorder
    deadline = time.monotonic() + 30
    while recorder.flushed < 4:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    async with gateway_state(app).db_engine.connect() as conn:
        users = sorted(
            (r.end_user or "")
            for r in await conn.execute(
                text("SELECT end_user FROM usage_records WHERE tenant_id = :t"), {"t": tenant["id"]}
            )
        )
    assert users == ["", "customer-42", "customer-42", "customer-7"]

    report = await client.get(
        "/v1/usage", params={"group_by": "user", "user": "customer-42"}, headers=bearer(key)
    )
    assert report.status_code == 200
    assert [(r["end_user"], r["requests"]) for r in report.json()["rows"]] == [("customer-42", 2)]


async def test_a_user_longer_than_256_characters_is_a_400(
    client: httpx.AsyncClient, create_tenant_and_key: Any, fake_engine: FakeEngine
) -> None:
    _, key, _ = await create_tenant_and_key()
    response = await client.post("/v1/chat/completions", json=chat(user="u" * 257), headers=bearer(key))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "user"
    assert not fake_engine.received
