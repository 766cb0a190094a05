"""Key lifecycle: create, list, update, revoke, rotate, and the startup bootstrap.

The secret exists in memory only while a create or rotate response is built; the table holds
``HMAC-SHA256(TERN_SECRET, key)``. A tenant-scoped admin manages only its own tenant's keys;
keys outside its reach answer 404 so their existence is not revealed.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.audit.service import record
from gateway.auth.identity import SYSTEM, Actor
from gateway.exceptions import Forbidden, InvalidInput
from gateway.keys.exceptions import BootstrapKeyProtected, KeyNotFound, KeyNotRotatable
from gateway.keys.format import bootstrap_key_problem, display_hint, generate_key, hash_key
from gateway.keys.models import ApiKey
from gateway.keys.schemas import KeyOut
from gateway.tenants.models import Tenant
from gateway.tenants.service import get_tenant

LIMIT_FIELDS = ("rpm_limit", "tpm_limit", "max_concurrency", "monthly_token_budget")
UPDATABLE_FIELDS = ("name", "models", *LIMIT_FIELDS, "expires_at")


def snapshot(key: ApiKey) -> dict[str, Any]:
    return KeyOut.model_validate(key).model_dump(mode="json")


def _audit(session: AsyncSession, *, key: ApiKey, **change: Any) -> None:
    """An audit row for a change to ``key``; ``change`` is the actor, action, before and after."""
    record(session, tenant_id=key.tenant_id, object_type="api_key", object_id=key.id, **change)


async def _resolve_tenant(
    session: AsyncSession, *, actor: Actor, tenant_id: uuid.UUID | None, kind: str
) -> Tenant | None:
    """The tenant a new key belongs to, after checking the actor may create keys there."""
    if not actor.is_platform:
        if tenant_id is not None and tenant_id != actor.tenant_id:
            raise Forbidden(
                "A tenant-scoped admin key can only create keys for its own tenant.",
                param="tenant_id",
                code="tenant_scope",
            )
        tenant_id = actor.tenant_id
    if tenant_id is None:
        if kind == "inference":
            raise InvalidInput("tenant_id is required for inference keys.", param="tenant_id")
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
        raise KeyNotFound(key_id)
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
            raise Forbidden(
                "A tenant-scoped admin key can only list its own tenant's keys.", param="tenant_id"
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


def canonical_models(requested: Sequence[str], *, served: Sequence[str]) -> tuple[list[str], list[str]]:
    """The key's model list spelled as ``/v1/models`` lists them, and a warning for each that no
    engine serves now (engines may be down, or a model not deployed yet: kept, not refused).

    Model ids are case-sensitive on the wire, so "smollm2-135m-instruct" for a served
    "SmolLM2-135M-Instruct" would make a key that can use nothing."""
    by_folded = {name.casefold(): name for name in served}
    models: list[str] = []
    warnings: list[str] = []
    for name in requested:
        canonical = by_folded.get(name.casefold())
        if canonical is None:
            warnings.append(
                f"No engine serves a model named {name!r} now (served: {', '.join(served) or 'none'})."
            )
        models.append(canonical or name)
    return list(dict.fromkeys(models)), warnings


def _refuse_if_protected(key: ApiKey, protected_hash: str | None) -> None:
    """``protected_hash``: the bootstrap admin key's hash, which the API may not revoke or expire."""
    if protected_hash is not None and key.secret_hash == protected_hash:
        raise BootstrapKeyProtected()


async def update_key(
    session: AsyncSession,
    *,
    actor: Actor,
    key_id: uuid.UUID,
    changes: dict[str, Any],
    protected_hash: str | None = None,
) -> ApiKey:
    """Apply ``changes`` (only fields in UPDATABLE_FIELDS; explicit ``None`` clears a field)."""
    unknown = set(changes) - set(UPDATABLE_FIELDS)
    if unknown:
        raise InvalidInput(f"Cannot update {sorted(unknown)}.", param=sorted(unknown)[0])
    if "name" in changes and changes["name"] is None:
        raise InvalidInput("name cannot be null.", param="name")
    if "models" in changes and changes["models"] is None:
        changes = {**changes, "models": []}
    key = await get_key(session, actor=actor, key_id=key_id)
    if "expires_at" in changes:
        _refuse_if_protected(key, protected_hash)
    before = snapshot(key)
    for field, value in changes.items():
        setattr(key, field, value)
    await session.flush()
    after = snapshot(key)
    if after != before:
        _audit(session, actor=actor, action="key.update", key=key, before=before, after=after)
    await session.commit()
    return key


async def revoke_key(
    session: AsyncSession, *, actor: Actor, key_id: uuid.UUID, protected_hash: str | None = None
) -> ApiKey:
    """Idempotent: revoking a revoked key changes nothing and writes no audit row."""
    key = await get_key(session, actor=actor, key_id=key_id)
    _refuse_if_protected(key, protected_hash)
    if key.revoked_at is None:
        before = snapshot(key)
        key.revoked_at = datetime.now(UTC)
        _audit(session, actor=actor, action="key.revoke", key=key, before=before, after=snapshot(key))
        await session.commit()
    return key


async def rotate_key(
    session: AsyncSession,
    *,
    actor: Actor,
    secret: bytes,
    key_id: uuid.UUID,
    grace_seconds: int = 0,
    protected_hash: str | None = None,
) -> tuple[ApiKey, ApiKey, str]:
    """A new key with the same scope and limits; the old one expires after ``grace_seconds``.

    Returns (old row, new row, new plaintext key)."""
    old = await get_key(session, actor=actor, key_id=key_id)
    _refuse_if_protected(old, protected_hash)
    now = datetime.now(UTC)
    if old.revoked_at is not None:
        raise KeyNotRotatable("revoked")
    if old.expires_at is not None and old.expires_at <= now:
        raise KeyNotRotatable("expired")
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
