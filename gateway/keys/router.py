"""``/admin/keys``: create (the secret is shown once), list, get, update, revoke and rotate."""

from __future__ import annotations

import uuid
from typing import Annotated, Literal, Protocol

from fastapi import APIRouter, Query, Request

from gateway.auth.deps import AdminActor
from gateway.bounds import Offset
from gateway.config import Settings
from gateway.db import DbSession
from gateway.keys import service
from gateway.keys.auth import KeyAuthenticator
from gateway.keys.format import hash_key
from gateway.keys.models import ApiKey
from gateway.keys.schemas import KeyCreate, KeyCreated, KeyList, KeyOut, KeyRotate, KeyUpdate, KeyWritten
from protocol.rpc import ModelInfo

router = APIRouter(prefix="/admin/keys", tags=["admin: keys"])


class ModelCatalog(Protocol):
    """What the key routes ask of the engine pool: the models served now."""

    def models(self) -> list[ModelInfo]: ...


class KeysState(Protocol):
    """What the key routes read from the app's state (``gateway.wiring.GatewayState``)."""

    settings: Settings
    key_authenticator: KeyAuthenticator
    engine_pool: ModelCatalog


def _state(request: Request) -> KeysState:
    return request.app.state.gateway


def _secret(request: Request) -> bytes:
    return _state(request).settings.secret_bytes()


def _bootstrap_hash(request: Request) -> str | None:
    """The hash of ``TERN_ADMIN_KEY``, which the API refuses to revoke, rotate or expire."""
    settings = _state(request).settings
    if settings.admin_key is None:
        return None
    return hash_key(settings.admin_key.get_secret_value(), settings.secret_bytes())


def _authenticator(request: Request) -> KeyAuthenticator:
    """This process's key cache; changes here are seen at once (other processes: within the TTL)."""
    return _state(request).key_authenticator


NO_GRACE = KeyRotate()


def _created(key: ApiKey, plaintext: str, warnings: list[str] | None = None) -> KeyCreated:
    return KeyCreated(**KeyOut.model_validate(key).model_dump(), key=plaintext, warnings=warnings or [])


def _canonical_models(request: Request, models: list[str]) -> tuple[list[str], list[str]]:
    served = [model.id for model in _state(request).engine_pool.models()]
    return service.canonical_models(models, served=served)


@router.post("", status_code=201)
async def create_key(body: KeyCreate, actor: AdminActor, session: DbSession, request: Request) -> KeyCreated:
    fields = body.model_dump()
    fields["models"], warnings = _canonical_models(request, fields["models"])
    key, plaintext = await service.create_key(session, actor=actor, secret=_secret(request), **fields)
    return _created(key, plaintext, warnings)


@router.get("")
async def list_keys(
    actor: AdminActor,
    session: DbSession,
    tenant_id: uuid.UUID | None = None,
    kind: Literal["inference", "admin"] | None = None,
    include_revoked: bool = True,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Offset = 0,
) -> KeyList:
    keys = await service.list_keys(
        session,
        actor=actor,
        tenant_id=tenant_id,
        kind=kind,
        include_revoked=include_revoked,
        limit=limit,
        offset=offset,
    )
    return KeyList(data=[KeyOut.model_validate(k) for k in keys])


@router.get("/{key_id}")
async def get_key(key_id: uuid.UUID, actor: AdminActor, session: DbSession) -> KeyOut:
    return KeyOut.model_validate(await service.get_key(session, actor=actor, key_id=key_id))


@router.patch("/{key_id}")
async def update_key(
    key_id: uuid.UUID, body: KeyUpdate, actor: AdminActor, session: DbSession, request: Request
) -> KeyWritten:
    changes = body.model_dump(include=body.model_fields_set)
    warnings: list[str] = []
    if changes.get("models"):
        changes["models"], warnings = _canonical_models(request, changes["models"])
    key = await service.update_key(
        session, actor=actor, key_id=key_id, changes=changes, protected_hash=_bootstrap_hash(request)
    )
    _authenticator(request).forget(key.secret_hash)
    return KeyWritten(**KeyOut.model_validate(key).model_dump(), warnings=warnings)


@router.post("/{key_id}/revoke")
async def revoke_key(key_id: uuid.UUID, actor: AdminActor, session: DbSession, request: Request) -> KeyOut:
    key = await service.revoke_key(
        session, actor=actor, key_id=key_id, protected_hash=_bootstrap_hash(request)
    )
    _authenticator(request).forget(key.secret_hash)
    return KeyOut.model_validate(key)


@router.post("/{key_id}/rotate", status_code=201)
async def rotate_key(
    key_id: uuid.UUID,
    actor: AdminActor,
    session: DbSession,
    request: Request,
    body: KeyRotate = NO_GRACE,  # no body: no grace; a JSON null is a 400, as the document says
) -> KeyCreated:
    grace_seconds = body.grace_seconds
    old, new, plaintext = await service.rotate_key(
        session,
        actor=actor,
        secret=_secret(request),
        key_id=key_id,
        grace_seconds=grace_seconds,
        protected_hash=_bootstrap_hash(request),
    )
    _authenticator(request).forget(old.secret_hash)
    return _created(new, plaintext)
