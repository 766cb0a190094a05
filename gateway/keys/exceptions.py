"""The key domain's refusals."""

from __future__ import annotations

import uuid
from typing import Literal

from gateway.exceptions import Conflict, NotFound


class KeyNotFound(NotFound):
    def __init__(self, key_id: uuid.UUID) -> None:
        super().__init__(f"API key {key_id} not found.", param="key_id", code="key_not_found")


class KeyNotRotatable(Conflict):
    """Only a live key can be rotated: a revoked or expired one has nothing left to hand over."""

    def __init__(self, reason: Literal["revoked", "expired"]) -> None:
        article = "a" if reason == "revoked" else "an"
        super().__init__(f"Cannot rotate {article} {reason} key.", code=f"key_{reason}")


class BootstrapKeyProtected(Conflict):
    """Revoking, rotating or expiring ``TERN_ADMIN_KEY`` through the API would lock the operator out."""

    def __init__(self) -> None:
        super().__init__(
            "The bootstrap admin key (TERN_ADMIN_KEY) cannot be revoked, rotated or given an expiry through "
            "the API: that would lock the operator out. To replace it, create another platform admin key "
            "(POST /admin/keys with kind 'admin', or `tern admin create-key --kind admin` on the server), "
            "then change TERN_ADMIN_KEY and restart.",
            code="bootstrap_key_protected",
        )
