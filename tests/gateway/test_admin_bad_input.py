"""Bad admin input gets OpenAI-shaped 400s (malformed JSON, unknown fields) and 413 (oversize body)."""

from __future__ import annotations

import httpx
import pytest

from gateway.config import Settings

pytestmark = pytest.mark.anyio


def assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    return error


async def test_malformed_json_is_400(client: httpx.AsyncClient, admin_headers: dict[str, str]) -> None:
    headers = {**admin_headers, "content-type": "application/json"}
    error = assert_error(await client.post("/admin/tenants", content=b'{"name": ', headers=headers), 400)
    assert "JSON" in error["message"]


async def test_unknown_field_is_400_naming_the_field(
    client: httpx.AsyncClient, admin_headers: dict[str, str]
) -> None:
    error = assert_error(
        await client.post("/admin/tenants", json={"name": "a", "colour": "red"}, headers=admin_headers), 400
    )
    assert error["param"] == "colour"
    tenant = (await client.post("/admin/tenants", json={"name": "b"}, headers=admin_headers)).json()
    body = {"tenant_id": tenant["id"], "name": "k", "kind": "inference", "secret_hash": "x"}
    assert assert_error(await client.post("/admin/keys", json=body, headers=admin_headers), 400)["param"] == (
        "secret_hash"
    )


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "name"),
        ({"name": ""}, "name"),
        ({"name": 5}, "name"),
    ],
)
async def test_invalid_tenant_fields_are_400(
    client: httpx.AsyncClient, admin_headers: dict[str, str], body: dict, param: str
) -> None:
    assert (
        assert_error(await client.post("/admin/tenants", json=body, headers=admin_headers), 400)["param"]
        == param
    )


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"kind": "superuser"}, "kind"),
        ({"rpm_limit": 0}, "rpm_limit"),
        ({"monthly_token_budget": -1}, "monthly_token_budget"),
        ({"expires_at": "2030-01-01T00:00:00"}, "expires_at"),  # no timezone
        ({"tenant_id": None}, "tenant_id"),  # inference keys need a tenant
    ],
)
async def test_invalid_key_fields_are_400(
    client: httpx.AsyncClient, admin_headers: dict[str, str], fields: dict, param: str
) -> None:
    tenant = (await client.post("/admin/tenants", json={"name": "t"}, headers=admin_headers)).json()
    body = {"tenant_id": tenant["id"], "name": "k", "kind": "inference", **fields}
    assert (
        assert_error(await client.post("/admin/keys", json=body, headers=admin_headers), 400)["param"]
        == param
    )


async def test_malformed_id_in_the_path_is_404(
    client: httpx.AsyncClient, admin_headers: dict[str, str]
) -> None:
    """A path whose id cannot be one names nothing, like an unknown id (and as the OpenAPI document's
    id pattern says: schemathesis follows links that yield "None")."""
    response = await client.get("/admin/keys/not-a-uuid", headers=admin_headers)
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


@pytest.fixture
def gateway_settings(gateway_settings: Settings) -> Settings:
    return gateway_settings.model_copy(update={"max_body_bytes": 1024})


async def test_oversize_body_is_413(client: httpx.AsyncClient, admin_headers: dict[str, str]) -> None:
    big = {"name": "x" * 2000}
    assert_error(await client.post("/admin/tenants", json=big, headers=admin_headers), 413)

    async def chunks():  # no content-length: the limit applies while reading
        yield b'{"name": "'
        for _ in range(4):
            yield b"y" * 512
        yield b'"}'

    headers = {**admin_headers, "content-type": "application/json"}
    error = assert_error(await client.post("/admin/tenants", content=chunks(), headers=headers), 413)
    assert "1024" in error["message"]
    assert (await client.get("/admin/tenants", headers=admin_headers)).json()["data"] == []


async def test_values_the_database_cannot_hold_are_400s_not_500s(
    client: httpx.AsyncClient, admin_headers: dict[str, str]
) -> None:
    """What schemathesis found (issue 18, defect 4): a NUL character, integers past their column."""
    tenant = await client.post("/admin/tenants", json={"name": "bounds"}, headers=admin_headers)
    if tenant.status_code == 409:  # the test database is shared by the session
        tenants = (await client.get("/admin/tenants?limit=1000", headers=admin_headers)).json()["data"]
        tenant_id = next(t["id"] for t in tenants if t["name"] == "bounds")
    else:
        tenant_id = tenant.json()["id"]
    responses = {
        "NUL in a query": await client.get("/admin/prices?model=%F0%97%A9%B9%00%0C6", headers=admin_headers),
        "NUL in a body": await client.post("/admin/tenants", json={"name": "a\x00b"}, headers=admin_headers),
        "int32 overflow": await client.put(
            f"/admin/limits/tenants/{tenant_id}", json={"tpm_limit": 14197686824}, headers=admin_headers
        ),
        "huge offset": await client.get(
            "/admin/keys?limit=889&offset=6295881734304937115826257920", headers=admin_headers
        ),
    }
    for case, response in responses.items():
        assert response.status_code in (400, 422), (case, response.text)
        assert_error(response, response.status_code)
    assert responses["int32 overflow"].json()["error"]["param"] == "tpm_limit"
    assert responses["huge offset"].json()["error"]["param"] == "offset"
    # An id past the column names nothing.
    huge_id = await client.delete("/admin/prices/99999999999999999999", headers=admin_headers)
    assert huge_id.status_code == 404
