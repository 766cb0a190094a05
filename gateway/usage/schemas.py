"""One metered request, as the proxy hands it over and as it is spooled to disk."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """Usage of one request. ``request_id`` plus ``started_at`` identify it: replays never count twice.

    ``prompt_tokens`` includes ``cached_tokens`` (OpenAI's convention).
    """

    request_id: str
    tenant_id: str
    key_id: str
    model: str
    endpoint: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    status: int
    finish_reason: str | None
    ttft_ms: float | None
    duration_ms: float
    started_at: datetime
    finished_at: datetime
    usage_estimated: bool = False
    """The engine reported no usage: the gateway counted it (last, with a default, so spool files
    written before the field existed still read)."""
    end_user: str | None = None
    """The request's OpenAI ``user`` field (with a default, like ``usage_estimated``)."""
    reasoning_tokens: int = 0
    """Of ``completion_tokens``, those spent thinking (with a default, like ``usage_estimated``)."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def is_error(self) -> bool:
        return self.status >= 400 or self.finish_reason == "error"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["started_at"] = self.started_at.isoformat()
        data["finished_at"] = self.finished_at.isoformat()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> UsageRecord:
        return cls(
            **{
                **data,
                "started_at": datetime.fromisoformat(data["started_at"]),
                "finished_at": datetime.fromisoformat(data["finished_at"]),
            }
        )
