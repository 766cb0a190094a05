"""Every admin mutation leaves exactly one audit row (rotation: two), with actor and before/after."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
import pytest
from credentials import bearer

pytestmark = pytest.mark.anyio


async def audit(client: httpx.AsyncClient, headers: dict[str, str], **filters: str) -> list[dict]:
    response = await client.get("/admin/audit", params=filters, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()["data"]


async def test_every_mutation_is_audited(client: httpx.AsyncClient, admin_headers: dict[str, str]) -> None:
    platform_key = next(
        k
        for k in (await client.get("/admin/keys", headers=admin_headers)).json()["data"]
        if k["tenant_id"] is None
    )
    baseline = len(await audit(client, admin_headers))

    tenant = (await client.post("/admin/tenants", json={"name": "a"}, headers=admin_headers)).json()
    tid = tenant["id"]
    await client.patch(f"/admin/tenants/{tid}", json={"status": "suspended"}, headers=admin_headers)
    key = (
        await client.post(
            "/admin/keys", json={"tenant_id": tid, "name": "k", "kind": "inference"}, headers=admin_headers
        )
    ).json()
    await client.patch(f"/admin/keys/{key['id']}", json={"rpm_limit": 5}, headers=admin_headers)
    rotated = (await client.post(f"/admin/keys/{key['id']}/rotate", headers=admin_headers)).json()
    await client.post(f"/admin/keys/{rotated['id']}/revoke", headers=admin_headers)
    await client.delete(f"/admin/tenants/{tid}", headers=admin_headers)

    rows = (await audit(client, admin_headers))[: -baseline or None]
    actions = [(r["action"], r["object_type"], r["object_id"]) for r in reversed(rows)]
    assert actions == [
        ("tenant.create", "tenant", tid),
        ("tenant.update", "tenant", tid),
        ("key.create", "api_key", key["id"]),
        ("key.update", "api_key", key["id"]),
        ("key.rotate", "api_key", key["id"]),
        ("key.create", "api_key", rotated["id"]),
        ("key.revoke", "api_key", rotated["id"]),
        ("tenant.delete", "tenant", tid),
    ]
    for row in rows:
        assert row["actor_key_id"] == platform_key["id"]
        assert row["tenant_id"] == tid
        assert row["request_id"]
        assert key["key"] not in str(row) and rotated["key"] not in str(row)
    update = next(r for r in rows if r["action"] == "key.update")
    assert update["before"]["rpm_limit"] is None and update["after"]["rpm_limit"] == 5
    assert "secret_hash" not in update["after"]
    suspend = next(r for r in rows if r["action"] == "tenant.update")
    assert suspend["before"]["status"] == "active" and suspend["after"]["status"] == "suspended"


async def test_no_op_changes_and_reads_are_not_audited(
    client: httpx.AsyncClient, admin_headers: dict[str, str]
) -> None:
    tenant = (await client.post("/admin/tenants", json={"name": "a"}, headers=admin_headers)).json()
    key = (
        await client.post(
            "/admin/keys",
            json={"tenant_id": tenant["id"], "name": "k", "kind": "admin"},
            headers=admin_headers,
        )
    ).json()
    before = len(await audit(client, admin_headers))
    await client.get(f"/admin/tenants/{tenant['id']}", headers=admin_headers)
    await client.get("/admin/keys", headers=bearer(key["key"]))
    await client.patch(f"/admin/tenants/{tenant['id']}", json={"status": "active"}, headers=admin_headers)
    await client.post(f"/admin/keys/{key['id']}/revoke", headers=admin_headers)
    await client.post(f"/admin/keys/{key['id']}/revoke", headers=admin_headers)  # already revoked
    assert len(await audit(client, admin_headers)) == before + 1


async def test_audit_filters(client: httpx.AsyncClient, admin_headers: dict[str, str]) -> None:
    first = (await client.post("/admin/tenants", json={"name": "one"}, headers=admin_headers)).json()
    second = (await client.post("/admin/tenants", json={"name": "two"}, headers=admin_headers)).json()
    body = {"tenant_id": first["id"], "name": "ops", "kind": "admin"}
    scoped = (await client.post("/admin/keys", json=body, headers=admin_headers)).json()
    await client.post("/admin/keys", json={"name": "x", "kind": "inference"}, headers=bearer(scoped["key"]))

    assert [r["object_id"] for r in await audit(client, admin_headers, action="tenant.create")] == [
        second["id"],
        first["id"],
    ]
    by_object = await audit(client, admin_headers, object_type="tenant", object_id=first["id"])
    assert [r["action"] for r in by_object] == ["tenant.create"]
    by_actor = await audit(client, admin_headers, actor=scoped["id"])
    assert [r["action"] for r in by_actor] == ["key.create"]
    assert len(await audit(client, admin_headers, limit="1")) == 1
    future = (datetime.now(UTC) + timedelta(minutes=5)).isoformat()
    assert await audit(client, admin_headers, since=future) == []
    assert len(await audit(client, admin_headers, until=future)) >= 4
    bad = await client.get("/admin/audit", params={"limit": "0"}, headers=admin_headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
