"""``/admin/limits``: whole-tenant limits and per-key extras (spend budget, Redis-outage policy, models).

A key's own rpm/tpm/concurrency/token budget are fields of ``/admin/keys``.
"""

from __future__ import annotations

import uuid
from typing import Protocol

from fastapi import APIRouter, Request

from gateway.auth.deps import AdminActor
from gateway.db import DbSession
from gateway.limits import admin
from gateway.limits.admission import RequestLimiter
from gateway.limits.schemas import KeyLimitsBody, KeyLimitsOut, TenantLimitsBody, TenantLimitsOut

router = APIRouter(prefix="/admin/limits", tags=["admin: limits"])


class LimitsState(Protocol):
    """What the limit routes read from the app's state (``gateway.wiring.GatewayState``)."""

    request_limiter: RequestLimiter


def _forget_cached(request: Request, key_id: uuid.UUID | None = None) -> None:
    """This process sees a change at once (other processes: within the policy cache's TTL)."""
    state: LimitsState = request.app.state.gateway
    state.request_limiter.policies.forget(key_id)


@router.get("/tenants/{tenant_id}")
async def get_tenant_limits(tenant_id: uuid.UUID, actor: AdminActor, session: DbSession) -> TenantLimitsOut:
    return await admin.get_tenant_limits(session, actor=actor, tenant_id=tenant_id)


@router.put("/tenants/{tenant_id}")
async def put_tenant_limits(
    tenant_id: uuid.UUID, body: TenantLimitsBody, actor: AdminActor, session: DbSession, request: Request
) -> TenantLimitsOut:
    out = await admin.put_tenant_limits(session, actor=actor, tenant_id=tenant_id, body=body)
    _forget_cached(request)
    return out


@router.get("/keys/{key_id}")
async def get_key_limits(key_id: uuid.UUID, actor: AdminActor, session: DbSession) -> KeyLimitsOut:
    return await admin.get_key_limits(session, actor=actor, key_id=key_id)


@router.put("/keys/{key_id}")
async def put_key_limits(
    key_id: uuid.UUID, body: KeyLimitsBody, actor: AdminActor, session: DbSession, request: Request
) -> KeyLimitsOut:
    out = await admin.put_key_limits(session, actor=actor, key_id=key_id, body=body)
    _forget_cached(request, key_id)
    return out
