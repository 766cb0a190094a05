"""The gateway tests' secrets and key helpers, in one module every test and the conftest import.

Kept out of ``conftest.py``: pytest loads a conftest under its own module name, so a test that
imported it by another path would load it a second time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

TEST_SECRET = "test-secret-for-hmac-0123456789abcdef"
TEST_ADMIN_KEY = "test-bootstrap-admin-key-0123456789abcdef"

CreateTenantAndKey = Callable[..., Awaitable[tuple[dict[str, Any], str, str]]]
"""The ``create_tenant_and_key`` fixture: ``await create(**key_fields)`` -> (tenant, key secret, key id)."""


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
