"""FastAPI dependencies for bearer-key authentication.

``InferenceKey`` guards the OpenAI surface, ``AdminKey`` guards ``/admin``. A missing, unknown,
revoked or expired key is 401; a key of the wrong kind or of a suspended/deleted tenant is 403.
"""

from __future__ import annotations

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


async def require_inference_key(request: Request) -> AuthenticatedKey:
    key = await authenticate_request(request)
    if key.kind != "inference":
        raise OpenAIError(
            403, "This endpoint needs an inference key; admin keys cannot call models.", code="wrong_key_kind"
        )
    return key


async def require_admin_key(request: Request) -> AuthenticatedKey:
    key = await authenticate_request(request)
    if key.kind != "admin":
        raise OpenAIError(
            403, "This endpoint needs an admin key; inference keys cannot use /admin.", code="wrong_key_kind"
        )
    return key


InferenceKey = Annotated[AuthenticatedKey, Depends(require_inference_key)]
AdminKey = Annotated[AuthenticatedKey, Depends(require_admin_key)]
