"""Bearer-key authentication for routes.

``InferenceKey`` guards the OpenAI surface, ``AdminKey`` guards ``/admin`` and ``AdminActor`` is the
admin key as the actor of a change (FastAPI dependencies).
The /v1 generation routes, which skip FastAPI's dependency solving, call :func:`authenticate_kind`
directly. A missing, unknown, revoked or expired key is 401; a key of the wrong kind or of a
suspended/deleted tenant is 403.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Literal, Protocol

from fastapi import Depends, Request
from starlette.types import Scope

from gateway.auth.identity import Actor, AuthenticatedKey, Authenticator
from gateway.errors import OpenAIError

KeyKind = Literal["inference", "admin"]

_WRONG_KIND = {
    "inference": "This endpoint needs an inference key; admin keys cannot call models.",
    "admin": "This endpoint needs an admin key; inference keys cannot use /admin.",
}


class AuthState(Protocol):
    """What authentication reads from the app's state (``gateway.wiring.GatewayState``)."""

    key_authenticator: Authenticator


def authenticator(scope: Scope) -> Authenticator:
    state: AuthState = scope["app"].state.gateway
    return state.key_authenticator


def authorization_header(scope: Scope) -> str | None:
    """The first ``Authorization`` header (ASGI header names arrive lower-cased)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            return value.decode("latin-1")
    return None


def bearer_token(header: str | None) -> str:
    if not header:
        raise OpenAIError(
            401,
            "Missing API key. Send it as 'Authorization: Bearer <key>'.",
            code="missing_api_key",
        )
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise OpenAIError(
            401,
            "Malformed Authorization header. Send 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
        )
    return token


async def authenticate_kind(scope: Scope, kind: KeyKind) -> AuthenticatedKey:
    """The request's key, which must be of ``kind``; its key and tenant go on the request state
    for the access log."""
    key = await authenticator(scope).authenticate(bearer_token(authorization_header(scope)))
    state = scope.setdefault("state", {})
    state["key_id"] = str(key.key_id)
    state["tenant_id"] = str(key.tenant_id) if key.tenant_id else None
    if key.kind != kind:
        raise OpenAIError(403, _WRONG_KIND[kind], code="wrong_key_kind")
    return key


def _require_kind(kind: KeyKind) -> Callable[[Request], Awaitable[AuthenticatedKey]]:
    async def require(request: Request) -> AuthenticatedKey:
        return await authenticate_kind(request.scope, kind)

    require.__name__ = f"require_{kind}_key"
    return require


require_inference_key = _require_kind("inference")
require_admin_key = _require_kind("admin")

InferenceKey = Annotated[AuthenticatedKey, Depends(require_inference_key)]
AdminKey = Annotated[AuthenticatedKey, Depends(require_admin_key)]


async def admin_actor(request: Request, key: AdminKey) -> Actor:
    """``async`` so FastAPI does not run it in a worker thread."""
    request_id = getattr(request.state, "request_id", None)
    return Actor(key_id=key.key_id, tenant_id=key.tenant_id, request_id=request_id)


AdminActor = Annotated[Actor, Depends(admin_actor)]
