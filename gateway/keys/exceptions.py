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
