"""Writing and reading the audit trail. Rows are added in the caller's transaction,
so a mutation and its audit row commit (or roll back) together."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.audit.models import AuditEntry
from gateway.auth.identity import Actor


def record(
    session: AsyncSession,
    *,
    actor: Actor,
    tenant_id: uuid.UUID | None,
    action: str,
    object_type: str,
    object_id: str | int | uuid.UUID,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
) -> AuditEntry:
    """Add an audit row for a change to an object belonging to ``tenant_id``."""
    entry = AuditEntry(
        actor_key_id=actor.key_id,
        tenant_id=tenant_id,
        action=action,
        object_type=object_type,
        object_id=str(object_id),
        before=before,
        after=after,
        request_id=actor.request_id,
    )
    session.add(entry)
    return entry


async def list_entries(
    session: AsyncSession,
    *,
    scope_tenant_id: uuid.UUID | None,
    action: str | None = None,
    object_type: str | None = None,
    object_id: str | None = None,
    actor_key_id: uuid.UUID | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = 100,
) -> list[AuditEntry]:
    """Newest first. ``scope_tenant_id`` restricts a tenant-scoped admin to its own tenant's rows."""
    query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
    if scope_tenant_id is not None:
        query = query.where(AuditEntry.tenant_id == scope_tenant_id)
    if action is not None:
        query = query.where(AuditEntry.action == action)
    if object_type is not None:
        query = query.where(AuditEntry.object_type == object_type)
    if object_id is not None:
        query = query.where(AuditEntry.object_id == object_id)
    if actor_key_id is not None:
        query = query.where(AuditEntry.actor_key_id == actor_key_id)
    if since is not None:
        query = query.where(AuditEntry.at >= since)
    if until is not None:
        query = query.where(AuditEntry.at < until)
    return list((await session.scalars(query)).all())
