"""Settings for rate limits and budgets (``TERN_LIMITS_*``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

FailurePolicy = Literal["closed", "open"]


class LimitsSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TERN_LIMITS_", extra="ignore")

    enabled: bool = True
    window_s: float = Field(60.0, gt=0, description="The sliding window of 'per minute' limits.")
    default_max_tokens: int = Field(
        4096, gt=0, description="Reserved completion tokens when a request sets no max_tokens, and the cap."
    )
    slot_ttl_s: float = Field(
        900.0, gt=0, description="A crashed request's concurrency slot frees itself after this long."
    )
    liveness_ttl_s: float = Field(
        10.0,
        gt=0,
        description="A gateway process not heard of for this long is dead: its concurrency slots are freed.",
    )
    failure_policy: FailurePolicy = Field(
        "closed", description="What a key does while Redis is unreachable, unless the key overrides it."
    )
    replicas: int = Field(1, ge=1, description="Gateway processes sharing the limits (for fail-open).")
    redis_retry_s: float = Field(1.0, gt=0, description="How long to stay on the fallback before retrying.")
    budget_status: Literal[402, 429] = Field(
        429, description="Status for a request whose worst case does not fit a token budget."
    )
    spend_budget_status: Literal[402, 429] = Field(
        402, description="Status for a request whose worst case does not fit a spend budget."
    )
    config_cache_s: float = Field(5.0, ge=0, description="How long tenant/key limit rows are cached.")
