"""The caller as the rest of the gateway sees it: an authenticated key, and the actor of an admin change."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class AuthenticatedKey:
    """Who is calling: what the rest of the gateway (limits, proxy, usage) needs about the key."""

    key_id: uuid.UUID
    tenant_id: uuid.UUID | None
    kind: str
    name: str
    models: tuple[str, ...]
    rpm_limit: int | None
    tpm_limit: int | None
    max_concurrency: int | None
    monthly_token_budget: int | None

    def may_use_model(self, model: str) -> bool:
        return not self.models or model in self.models


@dataclass(frozen=True, slots=True)
class Actor:
    """Who makes an admin change, and how far their reach goes."""

    key_id: uuid.UUID | None
    """The admin key used; None for the CLI and the startup bootstrap."""
    tenant_id: uuid.UUID | None
    """Set for a tenant-scoped admin key, which may touch only this tenant; None means platform-wide."""
    request_id: str | None = None

    @property
    def is_platform(self) -> bool:
        return self.tenant_id is None


SYSTEM = Actor(key_id=None, tenant_id=None, request_id=None)
"""The CLI and startup tasks: platform-wide, no key."""


class Authenticator(Protocol):
    """Turns a bearer token into a key (``gateway.keys.auth.KeyAuthenticator`` is the one wired in)."""

    async def authenticate(self, token: str) -> AuthenticatedKey: ...

    def forget_all(self) -> None:
        """Drop every cached key, after a change that affects many (a tenant suspended or deleted)."""
