"""401 versus 403: who you are (missing, unknown, revoked, expired key) versus what you may do."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from credentials import CreateTenantAndKey, bearer

from gateway.keys.format import generate_key
from gateway.wiring import gateway_state

pytestmark = pytest.mark.anyio


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": ""},
        {"Authorization": "Basic dXNlcjpwYXNz"},
        {"Authorization": "Bearer"},
        bearer("not-a-key"),
        bearer(generate_key("admin")[:-1] + "0"),  # bad checksum
        bearer(generate_key("admin")),  # well formed but never issued
        bearer("y" * 40),  # shaped like a bootstrap key but not registered
    ],
)
async def test_missing_or_invalid_key_is_401(client: httpx.AsyncClient, headers: dict[str, str]) -> None:
    error = assert_error(await client.get("/admin/tenants", headers=headers), 401)
    assert error["type"] == "authentication_error"


async def test_inference_key_cannot_use_admin(
    client: httpx.AsyncClient, create_tenant_and_key: CreateTenantAndKey
) -> None:
    tenant, secret, key_id = await create_tenant_and_key()
    for method, path in [
        ("GET", "/admin/tenants"),
        ("POST", "/admin/tenants"),
        ("GET", f"/admin/tenants/{tenant['id']}"),
        ("GET", "/admin/keys"),
        ("POST", f"/admin/keys/{key_id}/revoke"),
        ("GET", "/admin/audit"),
    ]:
        response = await client.request(method, path, headers=bearer(secret), json={"name": "x"})
        error = assert_error(response, 403, "wrong_key_kind")
        assert "inference keys cannot use /admin" in error["message"]


async def test_suspended_and_deleted_tenants_keys_are_403_and_resume_works(
    client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key: CreateTenantAndKey
) -> None:
    tenant, _, _ = await create_tenant_and_key()
    body = {"tenant_id": tenant["id"], "name": "ops", "kind": "admin"}
    admin_key = (await client.post("/admin/keys", json=body, headers=admin_headers)).json()["key"]
    url = f"/admin/tenants/{tenant['id']}"

    await client.patch(url, json={"status": "suspended"}, headers=admin_headers)
    assert_error(await client.get(url, headers=bearer(admin_key)), 403, "tenant_suspended")

    await client.patch(url, json={"status": "active"}, headers=admin_headers)
    assert (await client.get(url, headers=bearer(admin_key))).status_code == 200

    assert (await client.delete(url, headers=admin_headers)).status_code == 204
    assert_error(await client.get(url, headers=bearer(admin_key)), 403, "tenant_deleted")


async def test_bootstrap_admin_key_is_registered_once(
    client: httpx.AsyncClient, admin_headers: dict[str, str], app
) -> None:
    from credentials import TEST_ADMIN_KEY

    from gateway.keys.service import bootstrap_admin_key

    secret = app.state.settings.secret_bytes()
    assert not await bootstrap_admin_key(
        gateway_state(app).sessionmaker, admin_key=TEST_ADMIN_KEY, secret=secret
    )
    keys = (await client.get("/admin/keys?kind=admin", headers=admin_headers)).json()["data"]
    platform = [k for k in keys if k["tenant_id"] is None]
    assert len(platform) == 1 and platform[0]["hint"] == f"...{TEST_ADMIN_KEY[-4:]}"
    audit = (await client.get("/admin/audit?action=key.bootstrap", headers=admin_headers)).json()["data"]
    assert len(audit) == 1 and audit[0]["actor_key_id"] is None


async def test_bootstrap_is_idempotent_under_concurrency(
    client: httpx.AsyncClient, admin_headers: dict[str, str], app
) -> None:
    """Gateways starting together all register the same key: one insert wins, nobody fails."""
    from gateway.keys.service import bootstrap_admin_key

    new_key = "another-bootstrap-admin-key-0123456789-wxyz"
    secret = app.state.settings.secret_bytes()
    added = await asyncio.gather(
        *(
            bootstrap_admin_key(gateway_state(app).sessionmaker, admin_key=new_key, secret=secret)
            for _ in range(8)
        )
    )
    assert sorted(added) == [False] * 7 + [True]
    keys = (await client.get("/admin/keys?kind=admin", headers=admin_headers)).json()["data"]
    assert sum(k["hint"] == f"...{new_key[-4:]}" for k in keys) == 1
    audit = (await client.get("/admin/audit?action=key.bootstrap", headers=admin_headers)).json()["data"]
    assert len(audit) == 2  # the test key's and this one's, once each
    assert (await client.get("/admin/tenants", headers=bearer(new_key))).status_code == 200


async def test_a_bootstrap_key_that_could_not_authenticate_is_never_registered(
    client: httpx.AsyncClient, admin_headers: dict[str, str], app
) -> None:
    """Issue 18, defect 12: ``tern_`` + anything without a Tern checksum never passes the key check."""
    from gateway.keys.service import bootstrap_admin_key

    unusable = "tern_admin_" + "0123456789abcdef" * 2 + "QRST"
    secret = app.state.settings.secret_bytes()
    with pytest.raises(ValueError, match="checksum"):
        await bootstrap_admin_key(gateway_state(app).sessionmaker, admin_key=unusable, secret=secret)
    keys = (await client.get("/admin/keys?kind=admin", headers=admin_headers)).json()["data"]
    assert all(k["hint"] != f"...{unusable[-4:]}" for k in keys)

    generated = generate_key("admin")  # a key Tern generated may be the bootstrap key
    assert await bootstrap_admin_key(gateway_state(app).sessionmaker, admin_key=generated, secret=secret)
    assert (await client.get("/admin/tenants", headers=bearer(generated))).status_code == 200
