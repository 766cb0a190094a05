"""Reading and changing tenant limits and per-key limit extras (``/admin/limits``).

Only platform admins change limits (a tenant admin raising its own limits would defeat them);
tenant admins may read their own tenant's. Every change writes an audit row.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.audit.service import Actor, record
from gateway.errors import OpenAIError
from gateway.keys.models import ApiKey
from gateway.limits.models import KeyLimits, TenantLimits
from gateway.limits.schemas import KeyLimitsBody, KeyLimitsOut, TenantLimitsBody, TenantLimitsOut
from gateway.tenants.models import Tenant


def _platform_only(actor: Actor) -> None:
    if not actor.is_platform:
        raise OpenAIError(403, "Only a platform admin key can change limits.", code="platform_admin_required")


async def _tenant(session: AsyncSession, *, actor: Actor, tenant_id: uuid.UUID) -> Tenant:
    tenant = await session.get(Tenant, tenant_id)
    if (
        tenant is None
        or tenant.deleted_at is not None
        or (not actor.is_platform and actor.tenant_id != tenant_id)
    ):
        raise OpenAIError(404, f"Tenant {tenant_id} not found.", param="tenant_id", code="tenant_not_found")
    return tenant


async def _key(session: AsyncSession, *, actor: Actor, key_id: uuid.UUID) -> ApiKey:
    key = await session.get(ApiKey, key_id)
    if key is None or (not actor.is_platform and actor.tenant_id != key.tenant_id):
        raise OpenAIError(404, f"API key {key_id} not found.", param="key_id", code="key_not_found")
    return key


def _tenant_out(tenant_id: uuid.UUID, row: TenantLimits | None) -> TenantLimitsOut:
    if row is None:
        return TenantLimitsOut(tenant_id=str(tenant_id))
    body = {c: getattr(row, c) for c in TenantLimitsBody.model_fields}
    return TenantLimitsOut(tenant_id=str(tenant_id), **body)


def _key_out(key_id: uuid.UUID, row: KeyLimits | None) -> KeyLimitsOut:
    if row is None:
        return KeyLimitsOut(key_id=str(key_id))
    body = {c: getattr(row, c) for c in KeyLimitsBody.model_fields}
    return KeyLimitsOut(key_id=str(key_id), **body)


async def get_tenant_limits(session: AsyncSession, *, actor: Actor, tenant_id: uuid.UUID) -> TenantLimitsOut:
    await _tenant(session, actor=actor, tenant_id=tenant_id)
    return _tenant_out(tenant_id, await session.get(TenantLimits, tenant_id))


async def put_tenant_limits(
    session: AsyncSession, *, actor: Actor, tenant_id: uuid.UUID, body: TenantLimitsBody
) -> TenantLimitsOut:
    _platform_only(actor)
    await _tenant(session, actor=actor, tenant_id=tenant_id)
    row = await session.get(TenantLimits, tenant_id)
    before = _tenant_out(tenant_id, row).model_dump(mode="json") if row else None
    values = body.model_dump(mode="python")
    values["model_limits"] = body.model_dump(mode="json", exclude_none=True)["model_limits"]
    if row is None:
        row = TenantLimits(tenant_id=tenant_id, **values)
        session.add(row)
    else:
        for name, value in values.items():
            setattr(row, name, value)
    row.updated_at = datetime.now(UTC)
    after = _tenant_out(tenant_id, row)
    record(
        session,
        actor=actor,
        tenant_id=tenant_id,
        action="tenant_limits.update",
        object_type="tenant_limits",
        object_id=tenant_id,
        before=before,
        after=after.model_dump(mode="json"),
    )
    await session.commit()
    return after


async def get_key_limits(session: AsyncSession, *, actor: Actor, key_id: uuid.UUID) -> KeyLimitsOut:
    await _key(session, actor=actor, key_id=key_id)
    return _key_out(key_id, await session.get(KeyLimits, key_id))


async def put_key_limits(
    session: AsyncSession, *, actor: Actor, key_id: uuid.UUID, body: KeyLimitsBody
) -> KeyLimitsOut:
    _platform_only(actor)
    key = await _key(session, actor=actor, key_id=key_id)
    row = await session.get(KeyLimits, key_id)
    before = _key_out(key_id, row).model_dump(mode="json") if row else None
    values = body.model_dump(mode="python")
    values["model_limits"] = body.model_dump(mode="json", exclude_none=True)["model_limits"]
    if row is None:
        row = KeyLimits(key_id=key_id, **values)
        session.add(row)
    else:
        for name, value in values.items():
            setattr(row, name, value)
    row.updated_at = datetime.now(UTC)
    after = _key_out(key_id, row)
    record(
        session,
        actor=actor,
        tenant_id=key.tenant_id,
        action="key_limits.update",
        object_type="key_limits",
        object_id=key_id,
        before=before,
        after=after.model_dump(mode="json"),
    )
    await session.commit()
    return after
