"""Tenant lifecycle. A tenant-scoped admin sees only its own tenant and cannot change tenants;
creating, suspending and deleting tenants is for platform admins. Deletion is soft."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.audit.service import Actor, record
from gateway.errors import OpenAIError
from gateway.tenants.models import Tenant
from gateway.tenants.schemas import TenantOut


def snapshot(tenant: Tenant) -> dict[str, Any]:
    return TenantOut.model_validate(tenant).model_dump(mode="json")


def _audit(
    session: AsyncSession,
    *,
    actor: Actor,
    action: str,
    tenant: Tenant,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
) -> None:
    record(
        session,
        actor=actor,
        tenant_id=tenant.id,
        action=action,
        object_type="tenant",
        object_id=tenant.id,
        before=before,
        after=after,
    )


def _require_platform(actor: Actor, action: str) -> None:
    if not actor.is_platform:
        raise OpenAIError(
            403, f"Only a platform admin key can {action} tenants.", code="platform_admin_required"
        )


def _not_found(tenant_id: uuid.UUID) -> OpenAIError:
    return OpenAIError(404, f"Tenant {tenant_id} not found.", param="tenant_id", code="tenant_not_found")


def _name_taken(name: str) -> OpenAIError:
    return OpenAIError(409, f"A tenant named {name!r} already exists.", param="name", code="tenant_exists")


async def get_tenant(session: AsyncSession, *, actor: Actor, tenant_id: uuid.UUID) -> Tenant:
    """A live tenant the actor may see, else 404 (other tenants' existence is not revealed)."""
    if not actor.is_platform and actor.tenant_id != tenant_id:
        raise _not_found(tenant_id)
    tenant = await session.get(Tenant, tenant_id)
    if tenant is None or tenant.deleted_at is not None:
        raise _not_found(tenant_id)
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
        raise _name_taken(name) from None
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
        raise _name_taken(name or "") from None
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
