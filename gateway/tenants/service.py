"""Tenant lifecycle. A tenant-scoped admin sees only its own tenant and cannot change tenants;
creating, suspending and deleting tenants is for platform admins. Deletion is soft."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.audit.service import record
from gateway.auth.identity import Actor
from gateway.exceptions import PlatformAdminRequired
from gateway.tenants.exceptions import TenantNameTaken, TenantNotFound
from gateway.tenants.models import Tenant
from gateway.tenants.schemas import TenantOut


def snapshot(tenant: Tenant) -> dict[str, Any]:
    return TenantOut.model_validate(tenant).model_dump(mode="json")


def _audit(session: AsyncSession, *, tenant: Tenant, **change: Any) -> None:
    """An audit row for a change to ``tenant``; ``change`` is the actor, action, before and after."""
    record(session, tenant_id=tenant.id, object_type="tenant", object_id=tenant.id, **change)


def _require_platform(actor: Actor, action: str) -> None:
    if not actor.is_platform:
        raise PlatformAdminRequired(f"{action} tenants")


async def get_tenant(session: AsyncSession, *, actor: Actor, tenant_id: uuid.UUID) -> Tenant:
    """A live tenant the actor may see, else 404 (other tenants' existence is not revealed)."""
    if not actor.is_platform and actor.tenant_id != tenant_id:
        raise TenantNotFound(tenant_id)
    tenant = await session.get(Tenant, tenant_id)
    if tenant is None or tenant.deleted_at is not None:
        raise TenantNotFound(tenant_id)
    return tenant


async def list_tenants(session: AsyncSession, *, actor: Actor, limit: int, offset: int) -> list[Tenant]:
    query = select(Tenant).where(Tenant.deleted_at.is_(None)).order_by(Tenant.created_at, Tenant.id)
    if not actor.is_platform:
        query = query.where(Tenant.id == actor.tenant_id)
    return list((await session.scalars(query.limit(limit).offset(offset))).all())


async def create_tenant(session: AsyncSession, *, actor: Actor, name: str) -> Tenant:
    _require_platform(actor, "create")
    tenant = Tenant(id=uuid.uuid4(), name=name, status="active", created_at=datetime.now(UTC))
    session.add(tenant)
    try:
        await session.flush()
    except IntegrityError:
        await session.rollback()
        raise TenantNameTaken(name) from None
    _audit(session, actor=actor, action="tenant.create", tenant=tenant, before=None, after=snapshot(tenant))
    await session.commit()
    return tenant


async def update_tenant(
    session: AsyncSession,
    *,
    actor: Actor,
    tenant_id: uuid.UUID,
    name: str | None = None,
    status: str | None = None,
) -> Tenant:
    _require_platform(actor, "change")
    tenant = await get_tenant(session, actor=actor, tenant_id=tenant_id)
    before = snapshot(tenant)
    if name is not None:
        tenant.name = name
    if status is not None:
        tenant.status = status
    try:
        await session.flush()
    except IntegrityError:
        await session.rollback()
        raise TenantNameTaken(name or "") from None
    after = snapshot(tenant)
    if after != before:
        _audit(session, actor=actor, action="tenant.update", tenant=tenant, before=before, after=after)
    await session.commit()
    return tenant


async def delete_tenant(session: AsyncSession, *, actor: Actor, tenant_id: uuid.UUID) -> None:
    """Soft delete: the row stays (keys, usage and audit refer to it) but the tenant is gone
    from lists and its keys are refused with 403."""
    _require_platform(actor, "delete")
    tenant = await get_tenant(session, actor=actor, tenant_id=tenant_id)
    before = snapshot(tenant)
    tenant.deleted_at = datetime.now(UTC)
    _audit(session, actor=actor, action="tenant.delete", tenant=tenant, before=before, after=None)
    await session.commit()
