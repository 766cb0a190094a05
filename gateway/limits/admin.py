"""Reading and changing tenant limits and per-key limit extras (``/admin/limits``).

Only platform admins change limits (a tenant admin raising its own limits would defeat them);
tenant admins may read their own tenant's. Every change writes an audit row.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import TypeVar

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.audit.service import record
from gateway.auth.identity import Actor
from gateway.exceptions import PlatformAdminRequired
from gateway.keys.service import get_key
from gateway.limits.models import KeyLimits, TenantLimits
from gateway.limits.schemas import KeyLimitsBody, KeyLimitsOut, TenantLimitsBody, TenantLimitsOut
from gateway.tenants.service import get_tenant


def _platform_only(actor: Actor) -> None:
    if not actor.is_platform:
        raise PlatformAdminRequired("change limits")


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
    row: TenantLimits | KeyLimits | None = await session.get(row_cls, owner_id)
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
    await get_tenant(session, actor=actor, tenant_id=tenant_id)
    return _out(TenantLimitsOut, "tenant_id", tenant_id, await session.get(TenantLimits, tenant_id))


async def put_tenant_limits(
    session: AsyncSession, *, actor: Actor, tenant_id: uuid.UUID, body: TenantLimitsBody
) -> TenantLimitsOut:
    _platform_only(actor)
    await get_tenant(session, actor=actor, tenant_id=tenant_id)
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
    await get_key(session, actor=actor, key_id=key_id)
    return _out(KeyLimitsOut, "key_id", key_id, await session.get(KeyLimits, key_id))


async def put_key_limits(
    session: AsyncSession, *, actor: Actor, key_id: uuid.UUID, body: KeyLimitsBody
) -> KeyLimitsOut:
    _platform_only(actor)
    key = await get_key(session, actor=actor, key_id=key_id)
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
