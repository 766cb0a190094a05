"""Tenant isolation: a tenant-scoped admin key sees and changes only its own tenant."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from credentials import CreateTenantAndKey, bearer

pytestmark = pytest.mark.anyio


async def scoped_admin(
    client: httpx.AsyncClient, admin_headers: dict[str, str], tenant: dict[str, Any]
) -> dict[str, str]:
    body = {"tenant_id": tenant["id"], "name": "tenant admin", "kind": "admin"}
    response = await client.post("/admin/keys", json=body, headers=admin_headers)
    assert response.status_code == 201
    return bearer(response.json()["key"])


async def test_scoped_admin_never_reads_or_acts_on_another_tenant(
    client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key: CreateTenantAndKey
) -> None:
    mine, _, my_key_id = await create_tenant_and_key()
    theirs, _, their_key_id = await create_tenant_and_key()
    headers = await scoped_admin(client, admin_headers, mine)

    # Reads: only my tenant, my keys, my audit trail.
    tenants = (await client.get("/admin/tenants", headers=headers)).json()["data"]
    assert [t["id"] for t in tenants] == [mine["id"]]
    keys = (await client.get("/admin/keys", headers=headers)).json()["data"]
    assert {k["tenant_id"] for k in keys} == {mine["id"]} and my_key_id in {k["id"] for k in keys}
    audit = (await client.get("/admin/audit", headers=headers)).json()["data"]
    assert audit and {row["tenant_id"] for row in audit} == {mine["id"]}

    assert (await client.get(f"/admin/tenants/{theirs['id']}", headers=headers)).status_code == 404
    assert (await client.get(f"/admin/keys/{their_key_id}", headers=headers)).status_code == 404
    listing = await client.get(f"/admin/keys?tenant_id={theirs['id']}", headers=headers)
    assert listing.status_code == 403

    # Writes: nothing on the other tenant, and no tenant-level changes at all.
    for method, path, body in [
        ("PATCH", f"/admin/keys/{their_key_id}", {"rpm_limit": 1}),
        ("POST", f"/admin/keys/{their_key_id}/revoke", None),
        ("POST", f"/admin/keys/{their_key_id}/rotate", None),
    ]:
        response = await client.request(method, path, json=body, headers=headers)
        assert response.status_code == 404, (method, path)
    cross = {"tenant_id": theirs["id"], "name": "x", "kind": "inference"}
    assert (await client.post("/admin/keys", json=cross, headers=headers)).status_code == 403
    for method, path, body in [
        ("POST", "/admin/tenants", {"name": "new"}),
        ("PATCH", f"/admin/tenants/{theirs['id']}", {"status": "suspended"}),
        ("DELETE", f"/admin/tenants/{theirs['id']}", None),
        ("PATCH", f"/admin/tenants/{mine['id']}", {"status": "suspended"}),
    ]:
        response = await client.request(method, path, json=body, headers=headers)
        assert response.status_code == 403, (method, path)

    # The other tenant is untouched.
    their_key = (await client.get(f"/admin/keys/{their_key_id}", headers=admin_headers)).json()
    assert their_key["revoked_at"] is None and their_key["rpm_limit"] is None
    their_audit = (await client.get(f"/admin/audit?object_id={their_key_id}", headers=admin_headers)).json()
    assert [row["action"] for row in their_audit["data"]] == ["key.create"]


async def test_scoped_admin_manages_its_own_tenants_keys(
    client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key: CreateTenantAndKey
) -> None:
    mine, _, my_key_id = await create_tenant_and_key()
    headers = await scoped_admin(client, admin_headers, mine)

    created = await client.post("/admin/keys", json={"name": "app", "kind": "inference"}, headers=headers)
    assert created.status_code == 201 and created.json()["tenant_id"] == mine["id"]
    assert (await client.post(f"/admin/keys/{my_key_id}/revoke", headers=headers)).status_code == 200
    # It cannot mint platform-wide admin keys: its new admin keys are scoped to its tenant.
    admin = await client.post("/admin/keys", json={"name": "sub", "kind": "admin"}, headers=headers)
    assert admin.status_code == 201 and admin.json()["tenant_id"] == mine["id"]


async def test_platform_admin_keys_are_invisible_to_scoped_admins(
    client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key: CreateTenantAndKey
) -> None:
    mine, _, _ = await create_tenant_and_key()
    headers = await scoped_admin(client, admin_headers, mine)
    platform_keys = (await client.get("/admin/keys?kind=admin", headers=admin_headers)).json()["data"]
    platform_key_id = next(k["id"] for k in platform_keys if k["tenant_id"] is None)
    assert (await client.get(f"/admin/keys/{platform_key_id}", headers=headers)).status_code == 404
    assert (await client.post(f"/admin/keys/{platform_key_id}/revoke", headers=headers)).status_code == 404
