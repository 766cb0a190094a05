"""Prices and reports through the admin API on real Postgres: totals equal raw sums (tokens and
exact decimal cost), the CSV parses, prices take effect by day, and no tenant sees another's usage."""

from __future__ import annotations

import csv
import io
import json
import os
import random
import sys
import uuid
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import anyio
import httpx
import pytest
from credentials import bearer
from fastapi import FastAPI

from gateway.reports.schemas import METRICS
from gateway.usage.batch_writer import write_batch
from gateway.usage.schemas import UsageRecord
from gateway.wiring import gateway_state

pytestmark = pytest.mark.anyio

TODAY = datetime.now(UTC).date()
PRICES = {  # model -> (from day, prompt, cached, completion) per 1M tokens
    "m-a": [
        (TODAY - timedelta(days=30), "0.15", "0.075", "0.6"),
        (TODAY - timedelta(days=1), "0.2", "0.1", "0.8"),
    ],
    "m-b": [(TODAY - timedelta(days=30), "3", "1.5", "15.0000000001")],
}


def price_on(model: str, day: date) -> tuple[Decimal, Decimal, Decimal] | None:
    eligible = [p for p in PRICES.get(model, []) if p[0] <= day]
    if not eligible:
        return None
    _, prompt, cached, completion = max(eligible)
    return Decimal(prompt), Decimal(cached), Decimal(completion)


def cost_of(r: UsageRecord) -> Decimal:
    price = price_on(r.model, r.started_at.astimezone(UTC).date())
    if price is None:
        return Decimal(0)
    prompt, cached, completion = price
    micro = (
        (r.prompt_tokens - r.cached_tokens) * prompt
        + r.cached_tokens * cached
        + r.completion_tokens * completion
    )
    return micro / Decimal(1_000_000)


async def seed(app: FastAPI, owners: list[tuple[str, str]], n: int = 120) -> list[UsageRecord]:
    rng = random.Random(11)
    records = []
    for i in range(n):
        tenant_id, key_id = owners[i % len(owners)]
        prompt, completion = rng.randint(1, 5000), rng.randint(0, 2000)
        started = datetime.now(UTC) - timedelta(days=rng.randint(0, 3), minutes=rng.randint(0, 600))
        records.append(
            UsageRecord(
                request_id=f"r{i}-{uuid.uuid4().hex[:6]}",
                tenant_id=tenant_id,
                key_id=key_id,
                model=rng.choice(["m-a", "m-b", "m-unpriced"]),
                endpoint="chat.completions",
                prompt_tokens=prompt,
                cached_tokens=rng.randint(0, prompt),
                completion_tokens=completion,
                reasoning_tokens=rng.choice([0, rng.randint(0, completion)]),
                status=rng.choice([200, 200, 200, 502]),
                finish_reason="stop",
                ttft_ms=5.0,
                duration_ms=50.0,
                started_at=started,
                finished_at=started + timedelta(seconds=1),
                end_user=rng.choice(["alice", "bob", None]),
            )
        )
    await write_batch(gateway_state(app).db_engine, records, known_months=set())
    return records


@pytest.fixture
async def world(
    app: FastAPI, client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key
):
    for model, rows in PRICES.items():
        for day, prompt, cached, completion in rows:
            body = {
                "model": model,
                "effective_from": day.isoformat(),
                "prompt_per_mtok": prompt,
                "cached_prompt_per_mtok": cached,
                "completion_per_mtok": completion,
            }
            response = await client.post("/admin/prices", json=body, headers=admin_headers)
            assert response.status_code == 201, response.text
    tenant_a, key_a, key_a_id = await create_tenant_and_key()
    tenant_b, key_b, key_b_id = await create_tenant_and_key()
    records = await seed(app, [(tenant_a["id"], key_a_id), (tenant_b["id"], key_b_id)])
    return {
        "a": (tenant_a["id"], key_a, key_a_id),
        "b": (tenant_b["id"], key_b, key_b_id),
        "records": records,
    }


def expected_totals(records: list[UsageRecord]) -> dict[str, object]:
    return {
        "requests": len(records),
        "errors": sum(r.is_error for r in records),
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "cached_tokens": sum(r.cached_tokens for r in records),
        "completion_tokens": sum(r.completion_tokens for r in records),
        "reasoning_tokens": sum(r.reasoning_tokens for r in records),
        "total_tokens": sum(r.total_tokens for r in records),
        "cost": sum((cost_of(r) for r in records), Decimal(0)),
    }


def as_comparable(totals: dict[str, object]) -> dict[str, object]:
    return {k: Decimal(str(v)) if k == "cost" else v for k, v in totals.items()}


async def test_report_totals_equal_raw_sums_with_exact_cost(
    client: httpx.AsyncClient, admin_headers: dict[str, str], world
) -> None:
    start = (TODAY - timedelta(days=5)).isoformat()
    for group_by in ("day", "model", "key", "tenant", "day,model"):
        response = await client.get(
            "/admin/reports/usage", params={"from": start, "group_by": group_by}, headers=admin_headers
        )
        assert response.status_code == 200, response.text
        report = response.json()
        assert as_comparable(report["totals"]) == expected_totals(world["records"])
        for name in ("prompt_tokens", "completion_tokens", "requests"):
            assert sum(row[name] for row in report["rows"]) == report["totals"][name]
        assert sum(Decimal(row["cost"]) for row in report["rows"]) == Decimal(report["totals"]["cost"])

    by_model = (
        await client.get(
            "/admin/reports/usage", params={"from": start, "group_by": "model"}, headers=admin_headers
        )
    ).json()
    unpriced = next(row for row in by_model["rows"] if row["model"] == "m-unpriced")
    assert unpriced["cost"] == "0"
    for row in by_model["rows"]:
        mine = [r for r in world["records"] if r.model == row["model"]]
        assert as_comparable({k: row[k] for k in expected_totals(mine)}) == expected_totals(mine)


async def test_filters_and_csv(client: httpx.AsyncClient, admin_headers: dict[str, str], world) -> None:
    tenant_a, _, key_a_id = world["a"]
    params = {"from": (TODAY - timedelta(days=5)).isoformat(), "tenant": tenant_a, "model": "m-a"}
    response = await client.get(
        "/admin/reports/usage",
        params=params | {"group_by": "day,key", "format": "csv"},
        headers=admin_headers,
    )
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.text)))
    assert list(rows[0]) == [
        "day", "key_id", "requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens",
        "reasoning_tokens", "total_tokens", "cost",
    ]  # fmt: skip
    mine = [r for r in world["records"] if r.tenant_id == tenant_a and r.model == "m-a"]
    assert {row["key_id"] for row in rows} == {key_a_id}
    assert sum(int(row["completion_tokens"]) for row in rows) == sum(r.completion_tokens for r in mine)
    assert sum(int(row["reasoning_tokens"]) for row in rows) == sum(r.reasoning_tokens for r in mine)
    assert sum(Decimal(row["cost"]) for row in rows) == sum((cost_of(r) for r in mine), Decimal(0))

    bad = await client.get("/admin/reports/usage", params={"group_by": "week"}, headers=admin_headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("group_by")


async def test_bola_no_tenant_sees_another_tenants_usage(
    client: httpx.AsyncClient, admin_headers: dict[str, str], world
) -> None:
    tenant_a, key_a, key_a_id = world["a"]
    tenant_b, _, key_b_id = world["b"]
    start = (TODAY - timedelta(days=5)).isoformat()
    only_a = expected_totals([r for r in world["records"] if r.tenant_id == tenant_a])

    own = await client.get("/v1/usage", params={"from": start, "group_by": "key"}, headers=bearer(key_a))
    assert own.status_code == 200
    assert as_comparable(own.json()["totals"]) == only_a
    assert {row["key_id"] for row in own.json()["rows"]} == {key_a_id}
    # Asking for tenant B's key through tenant A's inference key yields nothing of B's.
    probe = await client.get("/v1/usage", params={"from": start, "key": key_b_id}, headers=bearer(key_a))
    assert probe.json()["rows"] == [] and probe.json()["totals"]["requests"] == 0

    created = await client.post(
        "/admin/keys", json={"tenant_id": tenant_a, "name": "a-admin", "kind": "admin"}, headers=admin_headers
    )
    a_admin = bearer(created.json()["key"])
    scoped = await client.get("/admin/reports/usage", params={"from": start}, headers=a_admin)
    assert as_comparable(scoped.json()["totals"]) == only_a
    other = await client.get("/admin/reports/usage", params={"tenant": tenant_b}, headers=a_admin)
    assert other.status_code == 403
    bill = await client.get(
        "/admin/reports/billing", params={"tenant": tenant_b, "month": "2026-01"}, headers=a_admin
    )
    assert bill.status_code == 403
    assert (await client.get("/admin/reports/usage", headers=bearer(key_a))).status_code == 403


async def test_monthly_bill_lines_follow_price_changes(
    client: httpx.AsyncClient, admin_headers: dict[str, str], world
) -> None:
    tenant_a, _, _ = world["a"]
    month = TODAY.strftime("%Y-%m")
    bill = await client.get(
        "/admin/reports/billing", params={"tenant": tenant_a, "month": month}, headers=admin_headers
    )
    assert bill.status_code == 200, bill.text
    body = bill.json()
    mine = [
        r for r in world["records"] if r.tenant_id == tenant_a and r.started_at.strftime("%Y-%m") == month
    ]
    assert Decimal(body["total_cost"]) == sum((cost_of(r) for r in mine), Decimal(0))
    assert sum(line["completion_tokens"] for line in body["lines"]) == sum(r.completion_tokens for r in mine)
    assert all(isinstance(line["cost"], str) for line in body["lines"])


async def test_prices_are_admin_managed_and_audited(
    client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key
) -> None:
    body = {
        "model": "m-x",
        "effective_from": "2026-01-01",
        "prompt_per_mtok": "0.1",
        "completion_per_mtok": 0.4,
    }
    created = await client.post("/admin/prices", json=body, headers=admin_headers)
    assert created.status_code == 201
    price = created.json()
    assert price["cached_prompt_per_mtok"] == "0.1" and price["completion_per_mtok"] == "0.4"
    assert (await client.post("/admin/prices", json=body, headers=admin_headers)).status_code == 409
    negative = await client.post(
        "/admin/prices", json=body | {"prompt_per_mtok": "-1"}, headers=admin_headers
    )
    assert negative.status_code == 400
    listed = await client.get("/admin/prices", params={"model": "m-x"}, headers=admin_headers)
    assert [p["id"] for p in listed.json()["data"]] == [price["id"]]

    tenant, _, _ = await create_tenant_and_key()
    tenant_admin = await client.post(
        "/admin/keys",
        json={"tenant_id": tenant["id"], "name": "t-admin", "kind": "admin"},
        headers=admin_headers,
    )
    forbidden = await client.post(
        "/admin/prices", json=body | {"model": "m-y"}, headers=bearer(tenant_admin.json()["key"])
    )
    assert forbidden.status_code == 403

    assert (await client.delete(f"/admin/prices/{price['id']}", headers=admin_headers)).status_code == 204
    audit = await client.get("/admin/audit", params={"object_type": "model_price"}, headers=admin_headers)
    assert [e["action"] for e in audit.json()["data"]] == ["price.delete", "price.create"]


async def test_tern_admin_report_prints_the_same_totals(world, gateway_settings) -> None:
    env = {**os.environ, "TERN_DATABASE_URL": gateway_settings.database_url}
    start = (TODAY - timedelta(days=5)).isoformat()
    command = [sys.executable, "-m", "tern_cli", "admin", "report", "--from", start, "--group-by", "model"]
    as_json = await anyio.run_process([*command, "--format", "json"], env=env)
    totals = json.loads(as_json.stdout)["totals"]
    assert as_comparable(totals) == expected_totals(world["records"])
    table = (await anyio.run_process(command, env=env)).stdout.decode()
    header, _, *body = table.splitlines()
    assert header.split() == ["model", *METRICS]
    assert body[-1].split()[0] == "TOTAL" and body[-1].split()[-1] == totals["cost"]


async def test_reports_by_end_user_equal_raw_sums_and_filter_and_csv(
    client: httpx.AsyncClient, admin_headers: dict[str, str], world
) -> None:
    start = (TODAY - timedelta(days=5)).isoformat()
    tenant_a = world["a"][0]
    mine = [r for r in world["records"] if r.tenant_id == tenant_a]
    response = await client.get(
        "/admin/reports/usage",
        params={"from": start, "tenant": tenant_a, "group_by": "user"},
        headers=admin_headers,
    )
    assert response.status_code == 200, response.text
    rows = {row["end_user"]: row for row in response.json()["rows"]}
    assert set(rows) == {"alice", "bob", None}
    for user, row in rows.items():
        expected = expected_totals([r for r in mine if r.end_user == user])
        assert as_comparable({k: row[k] for k in METRICS}) == as_comparable(expected)

    alice = await client.get(
        "/admin/reports/usage",
        params={"from": start, "tenant": tenant_a, "group_by": "day,model", "user": "alice", "format": "csv"},
        headers=admin_headers,
    )
    assert alice.status_code == 200
    parsed = list(csv.DictReader(io.StringIO(alice.text)))
    assert sum(int(r["requests"]) for r in parsed) == sum(r.end_user == "alice" for r in mine)

    by_user = await client.get(
        "/admin/reports/usage",
        params={"from": start, "tenant": tenant_a, "group_by": "user", "format": "csv"},
        headers=admin_headers,
    )
    parsed = list(csv.DictReader(io.StringIO(by_user.text)))
    assert {r["end_user"] for r in parsed} == {"alice", "bob", ""}
