"""Key lifecycle: create, list, update, revoke, rotate, and the startup bootstrap.

The secret exists in memory only while a create or rotate response is built; the table holds
``HMAC-SHA256(TERN_SECRET, key)``. A tenant-scoped admin manages only its own tenant's keys;
keys outside its reach answer 404 so their existence is not revealed.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.audit.service import SYSTEM, Actor, record
from gateway.errors import OpenAIError
from gateway.keys.format import bootstrap_key_problem, display_hint, generate_key, hash_key
from gateway.keys.models import ApiKey
from gateway.keys.schemas import KeyOut
from gateway.tenants.service import get_tenant

LIMIT_FIELDS = ("rpm_limit", "tpm_limit", "max_concurrency", "monthly_token_budget")
UPDATABLE_FIELDS = ("name", "models", *LIMIT_FIELDS, "expires_at")


def snapshot(key: ApiKey) -> dict[str, Any]:
    return KeyOut.model_validate(key).model_dump(mode="json")


def _audit(
    session: AsyncSession,
    *,
    actor: Actor,
    action: str,
    key: ApiKey,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
) -> None:
    record(
        session,
        actor=actor,
        tenant_id=key.tenant_id,
        action=action,
        object_type="api_key",
        object_id=key.id,
        before=before,
        after=after,
    )


def _not_found(key_id: uuid.UUID) -> OpenAIError:
    return OpenAIError(404, f"API key {key_id} not found.", code="key_not_found")


def _check_not_past(expires_at: datetime | None) -> None:
    if expires_at is not None and expires_at <= datetime.now(UTC):
        raise OpenAIError(400, "expires_at must be in the future.", param="expires_at")


async def _resolve_tenant(session: AsyncSession, *, actor: Actor, tenant_id: uuid.UUID | None, kind: str):
    """The tenant a new key belongs to, after checking the actor may create keys there."""
    if not actor.is_platform:
        if tenant_id is not None and tenant_id != actor.tenant_id:
            raise OpenAIError(
                403,
                "A tenant-scoped admin key can only create keys for its own tenant.",
                param="tenant_id",
                code="tenant_scope",
            )
        tenant_id = actor.tenant_id
    if tenant_id is None:
        if kind == "inference":
            raise OpenAIError(400, "tenant_id is required for inference keys.", param="tenant_id")
        return None  # a platform admin key
    return await get_tenant(session, actor=actor, tenant_id=tenant_id)


def _insert_key(session: AsyncSession, *, secret: bytes, kind: str, **fields: Any) -> tuple[ApiKey, str]:
    plaintext = generate_key(kind)
    key = ApiKey(
        id=uuid.uuid4(),
        kind=kind,
        hint=display_hint(plaintext),
        secret_hash=hash_key(plaintext, secret),
        created_at=datetime.now(UTC),
        **fields,
    )
    session.add(key)
    return key, plaintext


async def create_key(
    session: AsyncSession,
    *,
    actor: Actor,
    secret: bytes,
    tenant_id: uuid.UUID | None,
    kind: str,
    name: str,
    models: list[str] | None = None,
    rpm_limit: int | None = None,
    tpm_limit: int | None = None,
    max_concurrency: int | None = None,
    monthly_token_budget: int | None = None,
    expires_at: datetime | None = None,
) -> tuple[ApiKey, str]:
    """Returns the row and the plaintext key, which the caller shows once and forgets."""
    _check_not_past(expires_at)
    tenant = await _resolve_tenant(session, actor=actor, tenant_id=tenant_id, kind=kind)
    key, plaintext = _insert_key(
        session,
        secret=secret,
        kind=kind,
        tenant_id=tenant.id if tenant is not None else None,
        name=name,
        models=list(models or []),
        rpm_limit=rpm_limit,
        tpm_limit=tpm_limit,
        max_concurrency=max_concurrency,
        monthly_token_budget=monthly_token_budget,
        expires_at=expires_at,
    )
    await session.flush()
    _audit(session, actor=actor, action="key.create", key=key, before=None, after=snapshot(key))
    await session.commit()
    return key, plaintext


async def get_key(session: AsyncSession, *, actor: Actor, key_id: uuid.UUID) -> ApiKey:
    key = await session.get(ApiKey, key_id)
    if key is None or (not actor.is_platform and key.tenant_id != actor.tenant_id):
        raise _not_found(key_id)
    return key


async def list_keys(
    session: AsyncSession,
    *,
    actor: Actor,
    tenant_id: uuid.UUID | None = None,
    kind: str | None = None,
    include_revoked: bool = True,
    limit: int = 100,
    offset: int = 0,
) -> list[ApiKey]:
    if not actor.is_platform:
        if tenant_id is not None and tenant_id != actor.tenant_id:
            raise OpenAIError(
                403, "A tenant-scoped admin key can only list its own tenant's keys.", param="tenant_id"
            )
        tenant_id = actor.tenant_id
    query = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id).limit(limit).offset(offset)
    if tenant_id is not None:
        query = query.where(ApiKey.tenant_id == tenant_id)
    if kind is not None:
        query = query.where(ApiKey.kind == kind)
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    return list((await session.scalars(query)).all())


async def update_key(
    session: AsyncSession, *, actor: Actor, key_id: uuid.UUID, changes: dict[str, Any]
) -> ApiKey:
    """Apply ``changes`` (only fields in UPDATABLE_FIELDS; explicit ``None`` clears a field)."""
    unknown = set(changes) - set(UPDATABLE_FIELDS)
    if unknown:
        raise OpenAIError(400, f"Cannot update {sorted(unknown)}.", param=sorted(unknown)[0])
    if "name" in changes and changes["name"] is None:
        raise OpenAIError(400, "name cannot be null.", param="name")
    if "models" in changes and changes["models"] is None:
        changes = {**changes, "models": []}
    key = await get_key(session, actor=actor, key_id=key_id)
    if "expires_at" in changes:
        _check_not_past(changes["expires_at"])
    before = snapshot(key)
    for field, value in changes.items():
        setattr(key, field, value)
    await session.flush()
    after = snapshot(key)
    if after != before:
        _audit(session, actor=actor, action="key.update", key=key, before=before, after=after)
    await session.commit()
    return key


async def revoke_key(session: AsyncSession, *, actor: Actor, key_id: uuid.UUID) -> ApiKey:
    """Idempotent: revoking a revoked key changes nothing and writes no audit row."""
    key = await get_key(session, actor=actor, key_id=key_id)
    if key.revoked_at is None:
        before = snapshot(key)
        key.revoked_at = datetime.now(UTC)
        _audit(session, actor=actor, action="key.revoke", key=key, before=before, after=snapshot(key))
        await session.commit()
    return key


async def rotate_key(
    session: AsyncSession, *, actor: Actor, secret: bytes, key_id: uuid.UUID, grace_seconds: int = 0
) -> tuple[ApiKey, ApiKey, str]:
    """A new key with the same scope and limits; the old one expires after ``grace_seconds``.

    Returns (old row, new row, new plaintext key)."""
    old = await get_key(session, actor=actor, key_id=key_id)
    now = datetime.now(UTC)
    if old.revoked_at is not None:
        raise OpenAIError(409, "Cannot rotate a revoked key.", code="key_revoked")
    if old.expires_at is not None and old.expires_at <= now:
        raise OpenAIError(409, "Cannot rotate an expired key.", code="key_expired")
    before = snapshot(old)
    grace_end = now + timedelta(seconds=grace_seconds)
    old.expires_at = grace_end if old.expires_at is None else min(old.expires_at, grace_end)
    new, plaintext = _insert_key(
        session,
        secret=secret,
        kind=old.kind,
        tenant_id=old.tenant_id,
        models=list(old.models),
        **{field: getattr(old, field) for field in ("name", *LIMIT_FIELDS)},
        rotated_from=old.id,
    )
    await session.flush()
    _audit(
        session,
        actor=actor,
        action="key.rotate",
        key=old,
        before=before,
        after={**snapshot(old), "rotated_to": str(new.id)},
    )
    _audit(session, actor=actor, action="key.create", key=new, before=None, after=snapshot(new))
    await session.commit()
    return old, new, plaintext


async def bootstrap_admin_key(
    sessionmaker: async_sessionmaker[AsyncSession], *, admin_key: str, secret: bytes
) -> bool:
    """Register ``TERN_ADMIN_KEY`` as a platform admin key unless it already is. True if added.

    Safe to run from several gateway processes at once: ``INSERT ... ON CONFLICT DO NOTHING`` on the
    unique hash lets exactly one insert win (the others wait for it, then insert nothing), and only
    the winner writes the audit row, in the same transaction. A key that could never authenticate
    is refused (ValueError), never registered.
    """
    problem = bootstrap_key_problem(admin_key)
    if problem is not None:
        raise ValueError(problem)
    insert_once = (
        pg_insert(ApiKey)
        .values(
            id=uuid.uuid4(),
            tenant_id=None,
            kind="admin",
            name="bootstrap (TERN_ADMIN_KEY)",
            hint=f"...{admin_key[-4:]}",
            secret_hash=hash_key(admin_key, secret),
            models=[],
            created_at=datetime.now(UTC),
        )
        .on_conflict_do_nothing(index_elements=[ApiKey.secret_hash])
        .returning(ApiKey.id)
    )
    async with sessionmaker() as session:
        key_id = await session.scalar(insert_once)
        if key_id is None:
            return False
        key = await session.get_one(ApiKey, key_id)
        _audit(session, actor=SYSTEM, action="key.bootstrap", key=key, before=None, after=snapshot(key))
        await session.commit()
    return True
