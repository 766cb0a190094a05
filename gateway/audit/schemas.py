from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class AuditEntryOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    at: datetime
    actor_key_id: uuid.UUID | None
    tenant_id: uuid.UUID | None
    action: str
    object_type: str
    object_id: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    request_id: str | None


class AuditList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AuditEntryOut]
