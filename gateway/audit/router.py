"""``GET /admin/audit``: the audit trail, newest first, with filters."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query

from gateway.audit import service
from gateway.audit.schemas import AuditEntryOut, AuditList
from gateway.auth.deps import AdminActor
from gateway.bounds import Filter, IsoDateTime
from gateway.db import DbSession

router = APIRouter(prefix="/admin/audit", tags=["admin: audit"])


@router.get("")
async def list_audit(
    actor: AdminActor,
    session: DbSession,
    action: Filter | None = None,
    object_type: Filter | None = None,
    object_id: Filter | None = None,
    actor_key_id: Annotated[uuid.UUID | None, Query(alias="actor")] = None,
    since: IsoDateTime | None = None,
    until: IsoDateTime | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> AuditList:
    entries = await service.list_entries(
        session,
        scope_tenant_id=actor.tenant_id,
        action=action,
        object_type=object_type,
        object_id=object_id,
        actor_key_id=actor_key_id,
        since=since,
        until=until,
        limit=limit,
    )
    return AuditList(data=[AuditEntryOut.model_validate(e) for e in entries])
