"""The tenant domain's refusals."""

from __future__ import annotations

import uuid

from gateway.exceptions import Conflict, NotFound


class TenantNotFound(NotFound):
    def __init__(self, tenant_id: uuid.UUID) -> None:
        super().__init__(f"Tenant {tenant_id} not found.", param="tenant_id", code="tenant_not_found")


class TenantNameTaken(Conflict):
    def __init__(self, name: str) -> None:
        super().__init__(f"A tenant named {name!r} already exists.", param="name", code="tenant_exists")
