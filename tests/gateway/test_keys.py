"""API keys through the admin API: created and shown once, hidden in lists, revoked, rotated, expired."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from credentials import CreateTenantAndKey, bearer

import gateway.keys.auth
from gateway.keys.format import generate_key, has_valid_checksum, hash_key, key_kind

pytestmark = pytest.mark.anyio


async def whoami(client: httpx.AsyncClient, key: str) -> httpx.Response:
    """Any admin-guarded GET answers 401 for a bad key; with an inference key it answers 403."""
    return await client.get("/admin/tenants", headers=bearer(key))


async def create_admin_key(
    client: httpx.AsyncClient, admin_headers: dict[str, str], tenant_id: str
) -> dict[str, Any]:
    """A new admin key "a" of the tenant, as the API returns it (with ``key`` shown once)."""
    body = {"tenant_id": tenant_id, "name": "a", "kind": "admin"}
    created: dict[str, Any] = (await client.post("/admin/keys", json=body, headers=admin_headers)).json()
    return created


async def test_create_shows_the_key_once_and_lists_hide_it(
    client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key: CreateTenantAndKey
) -> None:
    tenant, secret, key_id = await create_tenant_and_key(models=["smollm2"], rpm_limit=60)
    assert has_valid_checksum(secret) and key_kind(secret) == "inference"

    listed = (await client.get(f"/admin/keys?tenant_id={tenant['id']}", headers=admin_headers)).json()
    fetched = (await client.get(f"/admin/keys/{key_id}", headers=admin_headers)).json()
    assert [k["id"] for k in listed["data"]] == [key_id]
    for shown in (listed["data"][0], fetched):
        assert "key" not in shown and "secret_hash" not in shown
        assert secret not in str(shown)
        assert shown["hint"] == f"tern_sk_...{secret[-4:]}"
        assert shown["models"] == ["smollm2"] and shown["rpm_limit"] == 60


async def test_key_authenticates_and_records_last_use(
    client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key: CreateTenantAndKey
) -> None:
    tenant, _, _ = await create_tenant_and_key()
    response = await client.post(
        "/admin/keys", json={"tenant_id": tenant["id"], "name": "ops", "kind": "admin"}, headers=admin_headers
    )
    admin_key = response.json()
    assert key_kind(admin_key["key"]) == "admin"
    assert admin_key["last_used_at"] is None

    assert (await whoami(client, admin_key["key"])).status_code == 200
    fetched = (await client.get(f"/admin/keys/{admin_key['id']}", headers=admin_headers)).json()
    assert fetched["last_used_at"] is not None


async def test_revoked_key_is_refused(
    client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key: CreateTenantAndKey
) -> None:
    tenant, _, _ = await create_tenant_and_key()
    created = await create_admin_key(client, admin_headers, tenant["id"])
    assert (await whoami(client, created["key"])).status_code == 200

    revoked = await client.post(f"/admin/keys/{created['id']}/revoke", headers=admin_headers)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None

    refused = await whoami(client, created["key"])
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "key_revoked"


async def test_a_known_keys_hash_is_memoised_and_revocation_still_refuses_it(
    client: httpx.AsyncClient,
    admin_headers: dict[str, str],
    create_tenant_and_key: CreateTenantAndKey,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hashed: list[str] = []

    def counting_hash_key(key: str, secret: bytes) -> str:
        hashed.append(key)
        return hash_key(key, secret)

    monkeypatch.setattr(gateway.keys.auth, "hash_key", counting_hash_key)
    tenant, _, _ = await create_tenant_and_key()
    created = await create_admin_key(client, admin_headers, tenant["id"])
    for _ in range(3):
        assert (await whoami(client, created["key"])).status_code == 200
    assert hashed.count(created["key"]) == 1  # one HMAC, then the memo

    revoked = await client.post(f"/admin/keys/{created['id']}/revoke", headers=admin_headers)
    assert revoked.status_code == 200
    refused = await whoami(client, created["key"])
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "key_revoked"
    assert hashed.count(created["key"]) == 1

    made_up = generate_key("admin")  # plausible but unknown: refused, and never memoised
    for _ in range(2):
        assert (await whoami(client, made_up)).status_code == 401
    assert hashed.count(made_up) == 2


async def test_rotation_with_grace_keeps_the_old_key_until_the_grace_ends(
    client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key: CreateTenantAndKey
) -> None:
    tenant, _, _ = await create_tenant_and_key()
    old = (
        await client.post(
            "/admin/keys",
            json={"tenant_id": tenant["id"], "name": "a", "kind": "admin", "rpm_limit": 7},
            headers=admin_headers,
        )
    ).json()

    rotated = await client.post(
        f"/admin/keys/{old['id']}/rotate", json={"grace_seconds": 3600}, headers=admin_headers
    )
    assert rotated.status_code == 201
    new = rotated.json()
    assert new["key"] != old["key"] and new["rotated_from"] == old["id"] and new["rpm_limit"] == 7
    assert (await whoami(client, new["key"])).status_code == 200
    assert (await whoami(client, old["key"])).status_code == 200  # still inside the grace period
    old_now = (await client.get(f"/admin/keys/{old['id']}", headers=admin_headers)).json()
    expires = datetime.fromisoformat(old_now["expires_at"])
    assert timedelta(minutes=59) < expires - datetime.now(UTC) <= timedelta(hours=1)

    # A JSON null is not "no body": refused as the OpenAPI document says, and nothing rotates.
    null_body = await client.post(
        f"/admin/keys/{new['id']}/rotate",
        content=b"null",
        headers=admin_headers | {"content-type": "application/json"},
    )
    assert null_body.status_code == 400 and null_body.json()["error"]["type"] == "invalid_request_error"
    assert (await whoami(client, new["key"])).status_code == 200

    # Rotating the new key without grace (no body) retires it at once.
    newest = (await client.post(f"/admin/keys/{new['id']}/rotate", headers=admin_headers)).json()
    refused = await whoami(client, new["key"])
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "key_expired"
    assert (await whoami(client, newest["key"])).status_code == 200


async def test_expired_key_is_refused(
    client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key: CreateTenantAndKey
) -> None:
    tenant, _, _ = await create_tenant_and_key()
    soon = datetime.now(UTC) + timedelta(seconds=1)
    created = (
        await client.post(
            "/admin/keys",
            json={"tenant_id": tenant["id"], "name": "a", "kind": "admin", "expires_at": soon.isoformat()},
            headers=admin_headers,
        )
    ).json()
    assert (await whoami(client, created["key"])).status_code == 200
    await asyncio.sleep(max(0.0, (soon - datetime.now(UTC)).total_seconds()) + 0.05)
    refused = await whoami(client, created["key"])
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "key_expired"


async def test_expiry_in_the_past_expires_the_key_at_once(
    client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key: CreateTenantAndKey
) -> None:
    """Any date-time is valid, as the OpenAPI document says: a past one expires the key now."""
    tenant, secret, key_id = await create_tenant_and_key()
    past = (datetime.now(UTC) - timedelta(minutes=1)).isoformat()
    body = {"tenant_id": tenant["id"], "name": "a", "kind": "inference", "expires_at": past}
    created = await client.post("/admin/keys", json=body, headers=admin_headers)
    assert created.status_code == 201, created.text
    assert (await client.get("/v1/models", headers=bearer(created.json()["key"]))).status_code == 401
    patched = await client.patch(f"/admin/keys/{key_id}", json={"expires_at": past}, headers=admin_headers)
    assert patched.status_code == 200
    assert (await client.get("/v1/models", headers=bearer(secret))).json()["error"]["code"] == "key_expired"


async def test_patch_changes_limits_and_clears_with_null(
    client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key: CreateTenantAndKey
) -> None:
    _, _, key_id = await create_tenant_and_key(rpm_limit=10, tpm_limit=1000)
    response = await client.patch(
        f"/admin/keys/{key_id}", json={"rpm_limit": 20, "tpm_limit": None}, headers=admin_headers
    )
    assert response.status_code == 200
    assert response.json()["rpm_limit"] == 20 and response.json()["tpm_limit"] is None
    assert response.json()["name"].endswith("-key")  # untouched


async def test_bootstrap_admin_key_cannot_revoke_rotate_or_expire_itself(
    client: httpx.AsyncClient, admin_headers: dict[str, str]
) -> None:
    """A fuzzer revoked TERN_ADMIN_KEY with itself and locked the operator out (issue 18, defect 6)."""
    keys = (await client.get("/admin/keys?kind=admin", headers=admin_headers)).json()["data"]
    [bootstrap] = [k for k in keys if k["name"] == "bootstrap (TERN_ADMIN_KEY)" and k["revoked_at"] is None]
    url = f"/admin/keys/{bootstrap['id']}"
    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    for response in (
        await client.post(f"{url}/revoke", headers=admin_headers),
        await client.post(f"{url}/rotate", headers=admin_headers),
        await client.patch(url, json={"expires_at": later}, headers=admin_headers),
    ):
        assert response.status_code == 409, response.text
        assert response.json()["error"]["code"] == "bootstrap_key_protected"
    assert (await whoami(client, admin_headers["Authorization"].removeprefix("Bearer "))).status_code == 200
    # Other changes to it, and revoking any other admin key, still work.
    assert (await client.patch(url, json={"rpm_limit": None}, headers=admin_headers)).status_code == 200
    other = await client.post("/admin/keys", json={"name": "second", "kind": "admin"}, headers=admin_headers)
    revoked = await client.post(f"/admin/keys/{other.json()['id']}/revoke", headers=admin_headers)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]


@pytest.mark.fake_engines(count=1)
async def test_key_models_are_spelled_as_served_and_unknown_ones_warned(
    client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key: CreateTenantAndKey
) -> None:
    """Model ids are case-sensitive on the wire: a key for "FAKE-MODEL" must still be able to use the
    served "fake-model" (issue 18, defect 10), and a model no engine serves is said, not silent."""
    await wait_for_models(client, admin_headers)
    tenant, _, key_id = await create_tenant_and_key()
    body = {"tenant_id": tenant["id"], "name": "k", "kind": "inference", "models": ["FAKE-MODEL", "gpt-4o"]}
    created = await client.post("/admin/keys", json=body, headers=admin_headers)
    assert created.status_code == 201, created.text
    assert created.json()["models"] == ["fake-model", "gpt-4o"]
    [warning] = created.json()["warnings"]
    assert "'gpt-4o'" in warning and "fake-model" in warning
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    answered = await client.post("/v1/chat/completions", json=chat, headers=bearer(created.json()["key"]))
    assert answered.status_code == 200, answered.text
    patched = await client.patch(
        f"/admin/keys/{key_id}", json={"models": ["Fake-Model"]}, headers=admin_headers
    )
    assert patched.json()["models"] == ["fake-model"] and patched.json()["warnings"] == []


async def wait_for_models(client: httpx.AsyncClient, admin_headers: dict[str, str]) -> None:
    """Until the engine pool's first health probe has listed the fake engine's model."""
    for _ in range(100):
        engines = (await client.get("/admin/engines", headers=admin_headers)).json()["data"]
        if any(e["healthy"] and e["models"] for e in engines):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the fake engine never became healthy")
