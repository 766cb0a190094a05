from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class EngineOut(BaseModel):
    """One engine as the gateway sees it: its health probe, plus its own ``/metrics`` when healthy.

    Metric fields are ``None`` when the engine is down or its metrics could not be read.
    """

    url: str
    kind: Literal["tern", "openai"] = "tern"
    """How the gateway talks to it: Tern's RPC, or the OpenAI API (``openai+http://`` entries)."""
    healthy: bool
    error: str | None
    models: list[str]
    inflight: int
    """Requests this gateway process has in flight to the engine."""
    running: int | None
    waiting: int | None
    kv_blocks_used: int | None
    kv_blocks_total: int | None
    kv_cache_usage: float | None
    """Fraction of KV-cache blocks in use, 0 to 1."""
    prompt_tokens: int | None
    cached_prompt_tokens: int | None
    prefix_cache_hit_rate: float | None
    """Prompt tokens served from the prefix cache over all prompt tokens, since the engine started."""


class EngineList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EngineOut]
