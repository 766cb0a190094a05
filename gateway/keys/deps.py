"""FastAPI dependencies for bearer-key authentication.

``InferenceKey`` guards the OpenAI surface, ``AdminKey`` guards ``/admin``. A missing, unknown,
revoked or expired key is 401; a key of the wrong kind or of a suspended/deleted tenant is 403.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Request

from gateway.errors import OpenAIError
from gateway.keys.auth import AuthenticatedKey, KeyAuthenticator

__all__ = ["AdminKey", "AuthenticatedKey", "InferenceKey", "require_admin_key", "require_inference_key"]


def bearer_token(request: Request) -> str:
    header = request.headers.get("authorization")
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


async def authenticate_request(request: Request) -> AuthenticatedKey:
    authenticator: KeyAuthenticator = request.app.state.key_authenticator
    key = await authenticator.authenticate(bearer_token(request))
    request.state.key_id = str(key.key_id)
    request.state.tenant_id = str(key.tenant_id) if key.tenant_id else None
    return key


def _require_kind(kind: str, refusal: str) -> Callable[[Request], Awaitable[AuthenticatedKey]]:
    async def require(request: Request) -> AuthenticatedKey:
        key = await authenticate_request(request)
        if key.kind != kind:
            raise OpenAIError(403, refusal, code="wrong_key_kind")
        return key

    require.__name__ = f"require_{kind}_key"
    return require


require_inference_key = _require_kind(
    "inference", "This endpoint needs an inference key; admin keys cannot call models."
)
require_admin_key = _require_kind(
    "admin", "This endpoint needs an admin key; inference keys cannot use /admin."
)

InferenceKey = Annotated[AuthenticatedKey, Depends(require_inference_key)]
AdminKey = Annotated[AuthenticatedKey, Depends(require_admin_key)]
