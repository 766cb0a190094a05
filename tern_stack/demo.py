"""The demo tenant and its inference key, provisioned through the running gateway's admin API."""

from __future__ import annotations

from typing import Any

import httpx

from tern_stack.state import StateDir

DEMO_TENANT = "demo"


def ensure_demo_key(url: str, admin_key: str, state: StateDir) -> str:
    """The demo tenant's inference key: the stored one if the gateway still accepts it, else a new one."""
    stored = state.root / "demo_key"
    with httpx.Client(base_url=url, timeout=30.0) as client:
        if stored.exists():
            key = stored.read_text().strip()
            if client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200:
                return key
            state.forget("demo_key")  # the data was reset or the key revoked: make a new one
        admin = {"Authorization": f"Bearer {admin_key}"}
        tenant = find_tenant(client, admin, DEMO_TENANT)
        if tenant is None:
            response = client.post("/admin/tenants", json={"name": DEMO_TENANT}, headers=admin)
            response.raise_for_status()
            tenant = response.json()
        response = client.post(
            "/admin/keys",
            json={"tenant_id": tenant["id"], "name": "tern up demo", "kind": "inference"},
            headers=admin,
        )
        response.raise_for_status()
        return state.secret("demo_key", lambda: response.json()["key"])


def find_tenant(client: httpx.Client, admin: dict[str, str], name: str) -> dict[str, Any] | None:
    response = client.get("/admin/tenants", params={"limit": 1000}, headers=admin)
    response.raise_for_status()
    return next((tenant for tenant in response.json()["data"] if tenant["name"] == name), None)


def model_id(url: str, key: str) -> str:
    """The first model the gateway lists."""
    response = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10.0)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])
