from __future__ import annotations

import uuid
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict

from gateway.bounds import Name

TenantName = Name
TenantStatus = Literal["active", "suspended"]


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: TenantName


class TenantUpdate(BaseModel):
    """Only the fields sent are changed; ``status`` suspends or resumes the tenant."""

    model_config = ConfigDict(extra="forbid")

    name: TenantName | None = None
    status: TenantStatus | None = None


class TenantOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    name: str
    status: TenantStatus
    created_at: datetime


class TenantList(BaseModel):
    object: Literal["list"] = "list"
    data: list[TenantOut]
