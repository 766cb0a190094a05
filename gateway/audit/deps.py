"""The ``Actor`` behind an admin request, for scoping and for the audit trail."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from gateway.audit.service import Actor
from gateway.keys.deps import AdminKey


async def admin_actor(request: Request, key: AdminKey) -> Actor:
    """``async`` so FastAPI does not run it in a worker thread."""
    request_id = getattr(request.state, "request_id", None)
    return Actor(key_id=key.key_id, tenant_id=key.tenant_id, request_id=request_id)


AdminActor = Annotated[Actor, Depends(admin_actor)]
