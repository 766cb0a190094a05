"""``/admin/tenants``: create, list, get, update (suspend/resume) and soft-delete tenants."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from gateway.auth.deps import AdminActor, authenticator
from gateway.bounds import Offset
from gateway.db import DbSession
from gateway.tenants import service
from gateway.tenants.schemas import TenantCreate, TenantList, TenantOut, TenantUpdate

router = APIRouter(prefix="/admin/tenants", tags=["admin: tenants"])


@router.post("", status_code=201)
async def create_tenant(body: TenantCreate, actor: AdminActor, session: DbSession) -> TenantOut:
    tenant = await service.create_tenant(session, actor=actor, name=body.name)
    return TenantOut.model_validate(tenant)


@router.get("")
async def list_tenants(
    actor: AdminActor,
    session: DbSession,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Offset = 0,
) -> TenantList:
    tenants = await service.list_tenants(session, actor=actor, limit=limit, offset=offset)
    return TenantList(data=[TenantOut.model_validate(t) for t in tenants])


@router.get("/{tenant_id}")
async def get_tenant(tenant_id: uuid.UUID, actor: AdminActor, session: DbSession) -> TenantOut:
    return TenantOut.model_validate(await service.get_tenant(session, actor=actor, tenant_id=tenant_id))


@router.patch("/{tenant_id}")
async def update_tenant(
    tenant_id: uuid.UUID, body: TenantUpdate, actor: AdminActor, session: DbSession, request: Request
) -> TenantOut:
    tenant = await service.update_tenant(
        session, actor=actor, tenant_id=tenant_id, name=body.name, status=body.status
    )
    authenticator(request.scope).forget_all()
    return TenantOut.model_validate(tenant)


@router.delete("/{tenant_id}", status_code=204)
async def delete_tenant(
    tenant_id: uuid.UUID, actor: AdminActor, session: DbSession, request: Request
) -> Response:
    await service.delete_tenant(session, actor=actor, tenant_id=tenant_id)
    authenticator(request.scope).forget_all()
    return Response(status_code=204)
