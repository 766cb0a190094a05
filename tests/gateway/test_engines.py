"""``GET /admin/engines``: each engine's health joined with its own Prometheus metrics."""

from __future__ import annotations

import httpx
import pytest
from credentials import bearer
from fake_engine import FakeEngine

from engine.metrics import EngineMetrics
from gateway.engines.service import parse_engine_metrics

pytestmark = pytest.mark.anyio


def engine_metrics_text() -> str:
    """What a real engine exports after 400 prompt tokens, 100 of them from the prefix cache."""
    metrics = EngineMetrics()
    metrics.set_queues(running=3, waiting=2, blocks_used=30, blocks_free=90)
    metrics.prompt_tokens.inc(400)
    metrics.cached_prompt_tokens.inc(100)
    return metrics.render().decode()


def test_parse_engine_metrics_reads_the_engine_exposition() -> None:
    values = parse_engine_metrics(engine_metrics_text())
    assert values == {
        "running": 3,
        "waiting": 2,
        "kv_blocks_used": 30,
        "kv_blocks_free": 90,
        "prompt_tokens": 400,
        "cached_prompt_tokens": 100,
    }


@pytest.mark.fake_engines()
async def test_engines_show_health_model_queues_and_caches(
    client: httpx.AsyncClient, admin_headers: dict[str, str], fake_engine: FakeEngine
) -> None:
    fake_engine.metrics_text = engine_metrics_text()
    response = await client.get("/admin/engines", headers=admin_headers)
    assert response.status_code == 200, response.text
    [engine] = response.json()["data"]
    assert engine["url"] == fake_engine.url and engine["kind"] == "tern"
    assert engine["healthy"] is True
    assert engine["models"] == [fake_engine.model]
    assert (engine["running"], engine["waiting"]) == (3, 2)
    assert (engine["kv_blocks_used"], engine["kv_blocks_total"]) == (30, 120)
    assert engine["kv_cache_usage"] == pytest.approx(0.25)
    assert engine["prefix_cache_hit_rate"] == pytest.approx(0.25)


@pytest.mark.fake_engines(healthy=False)
async def test_a_down_engine_is_listed_without_metrics(
    client: httpx.AsyncClient, admin_headers: dict[str, str], fake_engine: FakeEngine
) -> None:
    fake_engine.metrics_text = engine_metrics_text()
    [engine] = (await client.get("/admin/engines", headers=admin_headers)).json()["data"]
    assert engine["healthy"] is False
    assert engine["error"]
    assert engine["models"] == []
    assert engine["running"] is None and engine["kv_cache_usage"] is None


@pytest.mark.fake_engines()
async def test_engine_without_metrics_is_listed_with_nulls(
    client: httpx.AsyncClient, admin_headers: dict[str, str], fake_engine: FakeEngine
) -> None:
    fake_engine.metrics_text = "not prometheus {"
    [engine] = (await client.get("/admin/engines", headers=admin_headers)).json()["data"]
    assert engine["healthy"] is True
    assert engine["running"] is None and engine["prefix_cache_hit_rate"] is None


async def test_only_platform_admins_see_engines(
    client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key
) -> None:
    tenant, inference_key, _ = await create_tenant_and_key()
    body = {"tenant_id": tenant["id"], "name": "tenant-admin", "kind": "admin"}
    tenant_admin = (await client.post("/admin/keys", json=body, headers=admin_headers)).json()["key"]

    response = await client.get("/admin/engines", headers=bearer(tenant_admin))
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "platform_admin_required"
    assert (await client.get("/admin/engines", headers=bearer(inference_key))).status_code in (401, 403)
    assert (await client.get("/admin/engines")).status_code == 401
