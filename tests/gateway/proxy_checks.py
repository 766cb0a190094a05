"""What the proxy tests (test_proxy.py, test_proxy_refusals.py) check an answer with, and how they
take an engine out of rotation."""

from __future__ import annotations

from typing import Any

import httpx
from fake_engine import FakeEngine
from fastapi import FastAPI

from gateway.wiring import gateway_state

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "say hello"}]}


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
