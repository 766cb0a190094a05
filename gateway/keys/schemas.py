from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, StringConstraints

KeyName = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=200)]
ModelName = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=200)]
Limit = Annotated[int, Field(ge=1, le=2**31 - 1)]
Budget = Annotated[int, Field(ge=0, le=2**63 - 1)]
MAX_GRACE_SECONDS = 30 * 24 * 3600


class KeyCreate(BaseModel):
    """``tenant_id`` is required for inference keys; an admin key without one is platform-wide."""

    model_config = ConfigDict(extra="forbid")

    tenant_id: uuid.UUID | None = None
    name: KeyName
    kind: Literal["inference", "admin"]
    models: list[ModelName] = Field(default_factory=list, description="Allowed models; empty means all.")
    rpm_limit: Limit | None = None
    tpm_limit: Limit | None = None
    max_concurrency: Limit | None = None
    monthly_token_budget: Budget | None = None
    expires_at: AwareDatetime | None = None


class KeyUpdate(BaseModel):
    """Only the fields sent change; sending ``null`` clears a limit or the expiry."""

    model_config = ConfigDict(extra="forbid")

    name: KeyName | None = None
    models: list[ModelName] | None = None
    rpm_limit: Limit | None = None
    tpm_limit: Limit | None = None
    max_concurrency: Limit | None = None
    monthly_token_budget: Budget | None = None
    expires_at: AwareDatetime | None = None


class KeyRotate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grace_seconds: int = Field(0, ge=0, le=MAX_GRACE_SECONDS)


class KeyOut(BaseModel):
    """A key as lists show it: never the secret, never its hash."""

    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    tenant_id: uuid.UUID | None
    kind: Literal["inference", "admin"]
    name: str
    hint: str
    models: list[str]
    rpm_limit: int | None
    tpm_limit: int | None
    max_concurrency: int | None
    monthly_token_budget: int | None
    expires_at: datetime | None
    revoked_at: datetime | None
    created_at: datetime
    last_used_at: datetime | None
    rotated_from: uuid.UUID | None


class KeyCreated(KeyOut):
    """The create and rotate responses: the only time the secret ``key`` is ever shown."""

    key: str


class KeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[KeyOut]
