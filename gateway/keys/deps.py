"""Bearer-key authentication for routes.

``InferenceKey`` guards the OpenAI surface, ``AdminKey`` guards ``/admin`` (FastAPI dependencies).
The /v1 generation routes, which skip FastAPI's dependency solving, call :func:`authenticate_kind`
directly. A missing, unknown, revoked or expired key is 401; a key of the wrong kind or of a
suspended/deleted tenant is 403.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Literal

from fastapi import Depends, Request
from starlette.types import Scope

from gateway.errors import OpenAIError
from gateway.keys.auth import AuthenticatedKey, KeyAuthenticator

__all__ = [
    "AdminKey",
    "AuthenticatedKey",
    "InferenceKey",
    "authenticate_kind",
    "require_admin_key",
    "require_inference_key",
]

KeyKind = Literal["inference", "admin"]

_WRONG_KIND = {
    "inference": "This endpoint needs an inference key; admin keys cannot call models.",
    "admin": "This endpoint needs an admin key; inference keys cannot use /admin.",
}


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
    authenticator: KeyAuthenticator = scope["app"].state.key_authenticator
    key = await authenticator.authenticate(bearer_token(authorization_header(scope)))
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
