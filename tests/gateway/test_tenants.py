"""Tenants through the admin API: create, list, get, suspend/resume, rename, soft delete."""

from __future__ import annotations

import uuid

import httpx
import pytest

pytestmark = pytest.mark.anyio


async def test_tenant_lifecycle(client: httpx.AsyncClient, admin_headers: dict[str, str]) -> None:
    created = await client.post("/admin/tenants", json={"name": "acme"}, headers=admin_headers)
    assert created.status_code == 201
    tenant = created.json()
    assert set(tenant) == {"id", "name", "status", "created_at"}
    assert tenant["name"] == "acme" and tenant["status"] == "active"
    url = f"/admin/tenants/{tenant['id']}"

    assert (await client.get(url, headers=admin_headers)).json() == tenant
    listed = (await client.get("/admin/tenants", headers=admin_headers)).json()
    assert listed["object"] == "list" and [t["id"] for t in listed["data"]] == [tenant["id"]]

    suspended = await client.patch(url, json={"status": "suspended"}, headers=admin_headers)
    assert suspended.status_code == 200 and suspended.json()["status"] == "suspended"
    renamed = await client.patch(url, json={"name": "acme-corp", "status": "active"}, headers=admin_headers)
    assert renamed.json()["name"] == "acme-corp" and renamed.json()["status"] == "active"

    assert (await client.delete(url, headers=admin_headers)).status_code == 204
    assert (await client.get(url, headers=admin_headers)).status_code == 404
    assert (await client.get("/admin/tenants", headers=admin_headers)).json()["data"] == []
    assert (await client.delete(url, headers=admin_headers)).status_code == 404
    # Deletion is soft and frees the name.
    again = await client.post("/admin/tenants", json={"name": "acme-corp"}, headers=admin_headers)
    assert again.status_code == 201 and again.json()["id"] != tenant["id"]


async def test_duplicate_name_is_409(client: httpx.AsyncClient, admin_headers: dict[str, str]) -> None:
    assert (
        await client.post("/admin/tenants", json={"name": "dup"}, headers=admin_headers)
    ).status_code == 201
    response = await client.post("/admin/tenants", json={"name": "dup"}, headers=admin_headers)
    assert response.status_code == 409 and response.json()["error"]["param"] == "name"


async def test_unknown_tenant_is_404(client: httpx.AsyncClient, admin_headers: dict[str, str]) -> None:
    response = await client.get(f"/admin/tenants/{uuid.uuid4()}", headers=admin_headers)
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    body = {"tenant_id": str(uuid.uuid4()), "name": "k", "kind": "inference"}
    assert (await client.post("/admin/keys", json=body, headers=admin_headers)).status_code == 404


async def test_invalid_status_is_400(client: httpx.AsyncClient, admin_headers: dict[str, str]) -> None:
    tenant = (await client.post("/admin/tenants", json={"name": "t"}, headers=admin_headers)).json()
    response = await client.patch(
        f"/admin/tenants/{tenant['id']}", json={"status": "paused"}, headers=admin_headers
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "status"
