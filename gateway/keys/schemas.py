from __future__ import annotations

import uuid
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from gateway.bounds import Int64, IsoAwareDateTime, Name, json_int
from gateway.bounds import PositiveInt32 as Limit

KeyName = Name
ModelName = Name
MAX_GRACE_SECONDS = 30 * 24 * 3600


class KeyCreate(BaseModel):
    """``tenant_id`` is required for inference keys; an admin key without one is platform-wide."""

    model_config = ConfigDict(
        extra="forbid",
        # What the service checks, said in the document (a tenant admin's own tenant is implied).
        json_schema_extra={
            "if": {"properties": {"kind": {"const": "inference"}}},
            "then": {"required": ["tenant_id"], "properties": {"tenant_id": {"type": "string"}}},
        },
    )

    tenant_id: uuid.UUID | None = None
    name: KeyName
    kind: Literal["inference", "admin"]
    models: list[ModelName] = Field(default_factory=list, description="Allowed models; empty means all.")
    rpm_limit: Limit | None = None
    tpm_limit: Limit | None = None
    max_concurrency: Limit | None = None
    monthly_token_budget: Int64 | None = None
    expires_at: IsoAwareDateTime | None = None


class KeyUpdate(BaseModel):
    """Only the fields sent change; sending ``null`` clears a limit or the expiry."""

    model_config = ConfigDict(extra="forbid")

    name: KeyName | SkipJsonSchema[None] = None  # absent: unchanged; null is refused
    models: list[ModelName] | None = None
    rpm_limit: Limit | None = None
    tpm_limit: Limit | None = None
    max_concurrency: Limit | None = None
    monthly_token_budget: Int64 | None = None
    expires_at: IsoAwareDateTime | None = None


class KeyRotate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grace_seconds: json_int(ge=0, le=MAX_GRACE_SECONDS) = 0  # type: ignore[valid-type]


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


class KeyWritten(KeyOut):
    """The update response: the key, and what may not do what was meant."""

    warnings: list[str] = Field(
        default_factory=list, description="e.g. a model in 'models' that no engine serves now"
    )


class KeyCreated(KeyWritten):
    """The create and rotate responses: the only time the secret ``key`` is ever shown."""

    key: str


class KeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[KeyOut]
