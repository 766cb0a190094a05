"""Reading and changing tenant limits and per-key limit extras (``/admin/limits``).

Only platform admins change limits (a tenant admin raising its own limits would defeat them);
tenant admins may read their own tenant's. Every change writes an audit row.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import TypeVar

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


LimitsOut = TypeVar("LimitsOut", TenantLimitsOut, KeyLimitsOut)


def _out(
    out_cls: type[LimitsOut], owner: str, owner_id: uuid.UUID, row: TenantLimits | KeyLimits | None
) -> LimitsOut:
    """The API view of a limits row (``owner`` is ``tenant_id`` or ``key_id``); no row means no limits."""
    values = {} if row is None else {f: getattr(row, f) for f in out_cls.model_fields if f != owner}
    return out_cls(**{owner: str(owner_id)}, **values)


async def _save(
    session: AsyncSession,
    *,
    actor: Actor,
    row_cls: type[TenantLimits] | type[KeyLimits],
    out_cls: type[LimitsOut],
    owner: str,
    owner_id: uuid.UUID,
    tenant_id: uuid.UUID | None,
    body: TenantLimitsBody | KeyLimitsBody,
) -> LimitsOut:
    """Create or replace a limits row and audit the change, in one transaction."""
    row = await session.get(row_cls, owner_id)
    before = _out(out_cls, owner, owner_id, row).model_dump(mode="json") if row else None
    values = body.model_dump(mode="python")
    values["model_limits"] = body.model_dump(mode="json", exclude_none=True)["model_limits"]
    if row is None:
        row = row_cls(**{owner: owner_id}, **values)
        session.add(row)
    else:
        for name, value in values.items():
            setattr(row, name, value)
    row.updated_at = datetime.now(UTC)
    after = _out(out_cls, owner, owner_id, row)
    kind = owner.removesuffix("_id")
    record(
        session,
        actor=actor,
        tenant_id=tenant_id,
        action=f"{kind}_limits.update",
        object_type=f"{kind}_limits",
        object_id=owner_id,
        before=before,
        after=after.model_dump(mode="json"),
    )
    await session.commit()
    return after


async def get_tenant_limits(session: AsyncSession, *, actor: Actor, tenant_id: uuid.UUID) -> TenantLimitsOut:
    await _tenant(session, actor=actor, tenant_id=tenant_id)
    return _out(TenantLimitsOut, "tenant_id", tenant_id, await session.get(TenantLimits, tenant_id))


async def put_tenant_limits(
    session: AsyncSession, *, actor: Actor, tenant_id: uuid.UUID, body: TenantLimitsBody
) -> TenantLimitsOut:
    _platform_only(actor)
    await _tenant(session, actor=actor, tenant_id=tenant_id)
    return await _save(
        session,
        actor=actor,
        row_cls=TenantLimits,
        out_cls=TenantLimitsOut,
        owner="tenant_id",
        owner_id=tenant_id,
        tenant_id=tenant_id,
        body=body,
    )


async def get_key_limits(session: AsyncSession, *, actor: Actor, key_id: uuid.UUID) -> KeyLimitsOut:
    await _key(session, actor=actor, key_id=key_id)
    return _out(KeyLimitsOut, "key_id", key_id, await session.get(KeyLimits, key_id))


async def put_key_limits(
    session: AsyncSession, *, actor: Actor, key_id: uuid.UUID, body: KeyLimitsBody
) -> KeyLimitsOut:
    _platform_only(actor)
    key = await _key(session, actor=actor, key_id=key_id)
    return await _save(
        session,
        actor=actor,
        row_cls=KeyLimits,
        out_cls=KeyLimitsOut,
        owner="key_id",
        owner_id=key_id,
        tenant_id=key.tenant_id,
        body=body,
    )
