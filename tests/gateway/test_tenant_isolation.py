"""Tenant isolation over every route the app registers: what one tenant's key can never do to, or
learn about, another tenant.

The routes come from the app itself (``registered_routes``), so a new route is covered without
editing this file: an admin route is tried with another tenant's admin key aimed at the victim's
objects, with an inference key, and every route that needs a key with revoked, expired and
malformed credentials. Only a body schema or a path parameter this file has never seen makes it
fail until an example is added (it says which). The prompt-cache oracle, with real engines, is in
``test_tenant_isolation_cache.py``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from credentials import CreateTenantAndKey, bearer
from fastapi import FastAPI

from gateway.keys.format import generate_key

pytestmark = pytest.mark.anyio

PUBLIC_PATHS = {"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/"}
"""Routes that need no key (probes, the scrape, the API description and its page, the redirect to
the console, whose page asks for a key); every other needs one."""
PLATFORM_ONLY = {
    ("POST", "/admin/tenants"),
    ("POST", "/admin/prices"),
    ("DELETE", "/admin/prices/{price_id}"),
}
"""Admin routes a tenant-scoped admin key may not call at all (403), whatever it aims at."""


def registered_routes(app: FastAPI) -> Iterator[tuple[str, str]]:
    """(method, path template) of every HTTP route the app serves, included routers and the direct
    routes (``GatewayApp.add_direct_route``) alike; mounts (the console's files) have no methods."""
    for route in app.routes:
        contexts = getattr(route, "effective_route_contexts", None)
        for context in contexts() if contexts is not None else [route]:
            for method in sorted(getattr(context, "methods", None) or ()):
                if method != "HEAD":
                    yield method, context.path


def keyed_routes(app: FastAPI) -> list[tuple[str, str]]:
    return [(m, p) for m, p in registered_routes(app) if p not in PUBLIC_PATHS]


def admin_routes(app: FastAPI) -> list[tuple[str, str]]:
    return [(m, p) for m, p in keyed_routes(app) if p.startswith("/admin/")]


@dataclass
class Victim:
    """Another tenant and everything it owns that the admin API can name."""

    tenant_id: str
    name: str
    key_id: str
    admin_key_id: str
    budget_id: str
    price_id: str

    def ids(self) -> set[str]:
        return {self.tenant_id, self.name, self.key_id, self.admin_key_id}

    def path_value(self, parameter: str) -> str:
        values = {
            "tenant_id": self.tenant_id,
            "key_id": self.key_id,
            "budget_id": self.budget_id,
            "price_id": self.price_id,
        }
        assert parameter in values, f"add a value for the path parameter {parameter!r} to Victim"
        return values[parameter]

    def query(self, parameters: list[dict[str, Any]]) -> dict[str, str]:
        """Every query parameter that names a tenant or key names the victim's; required others get
        a valid value."""
        aimed = {
            "tenant_id": self.tenant_id,
            "tenant": self.tenant_id,
            "key_id": self.key_id,
            "key": self.key_id,
        }
        required = {"month": datetime.now(UTC).strftime("%Y-%m")}
        query: dict[str, str] = {}
        for parameter in parameters:
            name = parameter["name"]
            if parameter["in"] != "query":
                continue
            if name in aimed:
                query[name] = aimed[name]
            elif parameter.get("required"):
                assert name in required, f"add a value for the required query parameter {name!r}"
                query[name] = required[name]
        return query

    def body(self, schema_name: str) -> dict[str, Any]:
        """A valid body of each schema, aimed at the victim wherever it can name a tenant or key."""
        bodies: dict[str, dict[str, Any]] = {
            "TenantCreate": {"name": "intruder"},
            "TenantUpdate": {"status": "suspended", "name": "renamed"},
            "KeyCreate": {"tenant_id": self.tenant_id, "name": "intruder", "kind": "admin"},
            "KeyUpdate": {"rpm_limit": 1, "models": ["none"]},
            "KeyRotate": {"grace_seconds": 0},
            "TenantLimitsBody": {"rpm_limit": 1, "monthly_token_budget": 0},
            "KeyLimitsBody": {"failure_policy": "open", "max_tokens": 1},
            "BudgetCreate": {"tenant_id": self.tenant_id, "metric": "tokens", "period": "day", "amount": 0},
            "PriceCreate": {"model": "m", "prompt_per_mtok": "0", "completion_per_mtok": "0"},
        }
        assert schema_name in bodies, f"add an example body of {schema_name} to Victim.body"
        return bodies[schema_name]


@pytest.fixture
async def openapi(client: httpx.AsyncClient) -> dict[str, Any]:
    return (await client.get("/openapi.json")).json()


@pytest.fixture
async def victim(
    client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key: CreateTenantAndKey
) -> Victim:
    """A tenant with keys, a budget and limits, and a platform price, made by the platform admin."""
    admin = admin_headers
    tenant, _, key_id = await create_tenant_and_key()
    body = {"tenant_id": tenant["id"], "name": "victim admin", "kind": "admin"}
    admin_key = await client.post("/admin/keys", json=body, headers=admin)
    budget = {"tenant_id": tenant["id"], "key_id": key_id, "metric": "tokens", "period": "day", "amount": 500}
    created_budget = await client.post("/admin/budgets", json=budget, headers=admin)
    # Prices are the platform's, not the victim's: a scoped admin may read them, not change them.
    price = {"model": f"model-{uuid.uuid4().hex}", "prompt_per_mtok": "1", "completion_per_mtok": "2"}
    created_price = await client.post("/admin/prices", json=price, headers=admin)
    limits = {"rpm_limit": 100, "tpm_limit": 10_000}
    set_limits = await client.put(f"/admin/limits/tenants/{tenant['id']}", json=limits, headers=admin)
    for response in (admin_key, created_budget, created_price, set_limits):
        assert response.status_code in (200, 201), response.text
    return Victim(
        tenant_id=tenant["id"],
        name=tenant["name"],
        key_id=key_id,
        admin_key_id=admin_key.json()["id"],
        budget_id=str(created_budget.json()["id"]),
        price_id=str(created_price.json()["id"]),
    )


async def snapshot(client: httpx.AsyncClient, admin: dict[str, str], victim: Victim) -> list[Any]:
    """All the platform admin can read of the victim (and the platform's prices)."""
    reads = [
        f"/admin/tenants/{victim.tenant_id}",
        f"/admin/keys?tenant_id={victim.tenant_id}&include_revoked=true",
        f"/admin/budgets?tenant={victim.tenant_id}",
        f"/admin/limits/tenants/{victim.tenant_id}",
        f"/admin/limits/keys/{victim.key_id}",
        f"/admin/audit?object_id={victim.tenant_id}",
        f"/admin/audit?object_id={victim.key_id}",
        "/admin/prices",
    ]
    state = []
    for path in reads:
        response = await client.get(path, headers=admin)
        assert response.status_code == 200, (path, response.text)
        state.append(response.json())
    return state


def request_for(openapi: dict[str, Any], method: str, path: str, victim: Victim) -> dict[str, Any]:
    """The URL, query and body of one call to ``method path`` aimed at the victim's objects."""
    assert path in openapi["paths"], f"{path} is not in the OpenAPI document: describe it there"
    operation = openapi["paths"][path][method.lower()]
    url = path
    for parameter in operation.get("parameters", []):
        if parameter["in"] == "path":
            url = url.replace("{" + parameter["name"] + "}", victim.path_value(parameter["name"]))
    request: dict[str, Any] = {"url": url, "params": victim.query(operation.get("parameters", []))}
    schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    if schema is not None:
        request["json"] = victim.body(schema["$ref"].rsplit("/", 1)[-1])
    return request


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


async def test_another_tenants_admin_key_can_neither_change_nor_read_anything_of_the_victim(
    app: FastAPI,
    client: httpx.AsyncClient,
    admin_headers: dict[str, str],
    create_tenant_and_key: CreateTenantAndKey,
    victim: Victim,
    openapi: dict[str, Any],
) -> None:
    intruder_tenant, _, _ = await create_tenant_and_key()
    body = {"tenant_id": intruder_tenant["id"], "name": "intruder admin", "kind": "admin"}
    intruder = bearer((await client.post("/admin/keys", json=body, headers=admin_headers)).json()["key"])
    before = await snapshot(client, admin_headers, victim)

    tried = 0
    for method, path in admin_routes(app):
        response = await client.request(
            method, headers=intruder, **request_for(openapi, method, path, victim)
        )
        where = f"{method} {path}: {response.status_code} {response.text[:300]}"
        assert response.status_code != 422, f"the example did not validate, so nothing was checked: {where}"
        if (method, path) in PLATFORM_ONLY:
            assert response.status_code == 403, where
        elif response.status_code in (403, 404):
            assert_openai_error(response, response.status_code)
        else:  # allowed, but answered from the intruder's own tenant only
            assert response.status_code < 300, where
            assert not any(value in response.text for value in victim.ids()), f"leaks the victim: {where}"
        tried += 1

    assert tried >= 20  # every admin route the app has today
    assert await snapshot(client, admin_headers, victim) == before


async def test_inference_keys_reach_no_admin_route(
    app: FastAPI,
    client: httpx.AsyncClient,
    admin_headers: dict[str, str],
    create_tenant_and_key: CreateTenantAndKey,
    victim: Victim,
    openapi: dict[str, Any],
) -> None:
    _, own_secret, _ = await create_tenant_and_key()
    before = await snapshot(client, admin_headers, victim)
    for method, path in admin_routes(app):
        response = await client.request(
            method, headers=bearer(own_secret), **request_for(openapi, method, path, victim)
        )
        assert assert_openai_error(response, 403)["code"] == "wrong_key_kind", (method, path)
    assert await snapshot(client, admin_headers, victim) == before


async def wait_refused(client: httpx.AsyncClient, headers: dict[str, str], path: str) -> None:
    """A revocation reaches every gateway within the key cache's TTL (docs/gateway.md)."""
    for _ in range(100):
        if (await client.get(path, headers=headers)).status_code == 401:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{path} still accepts the key 5 s after its revocation")


async def test_revoked_and_expired_keys_are_401_on_every_keyed_route(
    app: FastAPI,
    client: httpx.AsyncClient,
    admin_headers: dict[str, str],
    create_tenant_and_key: CreateTenantAndKey,
) -> None:
    tenant, inference, inference_id = await create_tenant_and_key()
    body = {"tenant_id": tenant["id"], "name": "ops", "kind": "admin"}
    admin = (await client.post("/admin/keys", json=body, headers=admin_headers)).json()
    # Both keys work, then are revoked.
    assert (await client.get("/v1/models", headers=bearer(inference))).status_code == 200
    assert (await client.get("/admin/keys", headers=bearer(admin["key"]))).status_code == 200
    for key_id in (inference_id, admin["id"]):
        assert (await client.post(f"/admin/keys/{key_id}/revoke", headers=admin_headers)).status_code == 200
    await wait_refused(client, bearer(inference), "/v1/models")
    await wait_refused(client, bearer(admin["key"]), "/admin/keys")

    past = (datetime.now(UTC) - timedelta(minutes=1)).isoformat()
    expired = {}
    for kind in ("inference", "admin"):
        body = {"tenant_id": tenant["id"], "name": f"expired {kind}", "kind": kind, "expires_at": past}
        expired[kind] = (await client.post("/admin/keys", json=body, headers=admin_headers)).json()["key"]

    for method, path in keyed_routes(app):
        url = path.format(
            tenant_id=tenant["id"], key_id=inference_id, budget_id=inference_id, price_id=inference_id
        )
        for secret, code in [
            (inference, "key_revoked"),
            (admin["key"], "key_revoked"),
            (expired["inference"], "key_expired"),
            (expired["admin"], "key_expired"),
        ]:
            response = await client.request(method, url, headers=bearer(secret), json={})
            error = assert_openai_error(response, 401)
            assert error["type"] == "authentication_error" and error["code"] == code, (method, path, error)


MALFORMED = [
    {},
    {"Authorization": ""},
    {"Authorization": "Bearer"},
    {"Authorization": "Bearer "},
    {"Authorization": "bearer"},
    {"Authorization": "Basic dXNlcjpwYXNz"},
    {"Authorization": "Token abc"},
    bearer("not-a-key"),
    bearer("x" * 4096),
    bearer("tern_inference_\u00e9\u00e9"),
    bearer(generate_key("inference")[:-1] + "0"),  # bad checksum
    bearer(generate_key("admin")),  # well formed, never issued
]


async def test_malformed_authorization_is_401_on_every_keyed_route(
    app: FastAPI, client: httpx.AsyncClient
) -> None:
    routes = keyed_routes(app)
    assert any(p.startswith("/v1/") for _, p in routes) and any(p.startswith("/admin/") for _, p in routes)
    for method, path in routes:
        url = path.format(tenant_id="0" * 32, key_id="0" * 32, budget_id="0" * 32, price_id="0" * 32)
        for headers in MALFORMED:
            encoded = {k: v.encode("utf-8") for k, v in headers.items()}  # non-ASCII goes out as raw bytes
            response = await client.request(method, url, headers=encoded, content=json.dumps({}))
            error = assert_openai_error(response, 401)
            assert error["type"] == "authentication_error", (method, path, headers, error)


async def test_the_route_walk_sees_the_direct_routes_and_the_routers(app: FastAPI) -> None:
    """The suite is only as good as its walk: it must see both kinds of route the app registers."""
    routes = set(registered_routes(app))
    assert ("POST", "/v1/chat/completions") in routes  # a direct route (GatewayApp.add_direct_route)
    assert ("GET", "/admin/keys") in routes and ("DELETE", "/admin/budgets/{budget_id}") in routes
    openapi_paths = {
        (m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops if m.upper() != "HEAD"
    }
    assert openapi_paths <= routes
