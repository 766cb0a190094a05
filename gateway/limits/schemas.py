"""What a request is limited by, and what admission decided."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Annotated, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from gateway import keyspace
from gateway.bounds import Int32, Int64, Name, PositiveInt32
from gateway.bounds import Numeric20_6 as Spend
from gateway.budgets.periods import Period, period_id
from gateway.budgets.rules import BudgetRule, nano_str
from gateway.limits.config import FailurePolicy
from gateway.limits.script_batch import Packed

ScopeKind = Literal["key", "tenant", "key_model", "tenant_model"]


@dataclass(frozen=True, slots=True)
class Scope:
    """One thing a request counts against (a key, a tenant, or either for one model).

    ``None`` means "no limit" for every field; ``budgets`` holds every budget of the scope.
    """

    kind: ScopeKind
    id: str
    label: str
    model: str | None = None
    rpm: int | None = None
    tpm: int | None = None
    concurrency: int | None = None
    budgets: tuple[BudgetRule, ...] = ()
    tenant_id: str | None = None
    """The tenant the scope belongs to (for the audit row of a budget alert)."""

    @property
    def name(self) -> str:
        owner: keyspace.ScopeKind = "key" if self.kind.startswith("key") else "tenant"
        return keyspace.scope_name(owner, self.id, self.model)

    @property
    def has_budget(self) -> bool:
        return bool(self.budgets)

    @property
    def has_spend_budget(self) -> bool:
        return any(b.metric == "spend" for b in self.budgets)

    @property
    def is_limited(self) -> bool:
        return self.has_budget or any(v is not None for v in (self.rpm, self.tpm, self.concurrency))

    @property
    def periods(self) -> tuple[Period, ...]:
        """The periods of its budgets, each once, in the order the scripts number them (from 1)."""
        return tuple(dict.fromkeys(b.period for b in self.budgets))

    def redis_keys(self, day: date) -> list[str]:
        """The scripts' keys of this scope (``keyspace.scope_keys``) on ``day``."""
        return keyspace.scope_keys(self.name, (period_id(p, day) for p in self.periods))

    def script_args(self) -> list[int]:
        """Its limits as the scripts take them (``keyspace.scope_limit_args``)."""

        def n(value: int | None) -> int:
            return -1 if value is None else value

        periods = self.periods
        return keyspace.scope_limit_args(
            rpm=n(self.rpm),
            tpm=n(self.tpm),
            concurrency=n(self.concurrency),
            n_periods=len(periods),
            budgets=[(periods.index(b.period) + 1, b.code, b.limit, n(b.alert_at)) for b in self.budgets],
        )


@dataclass(frozen=True, slots=True)
class BudgetSlot:
    """One budget of one scope of a request, in the scripts' order."""

    scope: Scope
    rule: BudgetRule
    label: str
    """``<scope>:<metric>:<period>``: the used-ratio gauge's label, the fail-open fallback's key."""


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Everything admission needs to know about one request's key.

    Built once per key, model and cache period (``LimitPolicies``) and shared by its requests, so
    the script's keys and limit arguments are worked out, and encoded for Redis, once, not per
    request (the keys once per UTC day: budget counters are named by their period).
    """

    scopes: tuple[Scope, ...]
    failure_policy: FailurePolicy
    max_tokens: int | None = None
    """The key's, else its tenant's ``max_tokens`` setting; None: the gateway's default."""
    # Worked out once from the scopes (``__post_init__``), read by every request:
    budgets: tuple[BudgetSlot, ...] = field(init=False, compare=False, repr=False)
    has_spend_budget: bool = field(init=False, compare=False, repr=False)
    counts_tokens: bool = field(init=False, compare=False, repr=False)
    """Some scope has a tpm limit or a budget: the prompt's token count matters."""
    window_fields: tuple[int, ...] = field(init=False, compare=False, repr=False)
    """Where each scope's six window fields start in admit.lua's "ok" reply."""
    key_token_fields: tuple[int, ...] = field(init=False, compare=False, repr=False)
    """Where the key's token budgets' "left" are in that reply (for the budget headers)."""
    key_spend_fields: tuple[int, ...] = field(init=False, compare=False, repr=False)
    script_tries: int = field(init=False, compare=False, repr=False)
    """How often admission may run the script: once, plus a seeding of every period's counter and
    a reaping of every scope."""
    _keys_by_day: dict[date, Packed] = field(default_factory=dict, compare=False, repr=False)
    _packed: dict[str, Packed] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        budgets: list[BudgetSlot] = []
        windows: list[int] = []
        key_tokens: list[int] = []
        key_spend: list[int] = []
        at = 2  # "ok now_ms"
        for scope in self.scopes:
            windows.append(at)
            at += 6
            for rule in scope.budgets:
                budgets.append(BudgetSlot(scope, rule, f"{scope.name}:{rule.name}"))
                if scope.kind == "key":
                    (key_tokens if rule.metric == "tokens" else key_spend).append(at)
                at += 1
        set_field = object.__setattr__  # frozen: set once, here
        set_field(self, "budgets", tuple(budgets))
        set_field(self, "has_spend_budget", any(s.has_spend_budget for s in self.scopes))
        set_field(self, "counts_tokens", any(s.tpm is not None or s.budgets for s in self.scopes))
        set_field(self, "window_fields", tuple(windows))
        set_field(self, "key_token_fields", tuple(key_tokens))
        set_field(self, "key_spend_fields", tuple(key_spend))
        set_field(self, "script_tries", sum(len(s.periods) for s in self.scopes) + len(self.scopes) + 1)

    def redis_keys(self, day: date) -> Packed:
        """Every scope's keys, in the scripts' order."""
        keys = self._keys_by_day.get(day)
        if keys is None:
            if len(self._keys_by_day) > 2:  # only today and tomorrow matter
                self._keys_by_day.clear()
            keys = self._keys_by_day[day] = Packed.of(k for s in self.scopes for k in s.redis_keys(day))
        return keys

    def settle_args(self) -> Packed:
        """The number of scopes, then every scope's periods and budgets, in settle.lua's order."""
        packed = self._packed.get("settle")
        if packed is None:
            tail = keyspace.settlement_tail([s.script_args() for s in self.scopes])
            packed = self._packed["settle"] = Packed.of(tail)
        return packed

    def limit_args(self) -> Packed:
        """The number of scopes, then every scope's limits, in the scripts' order."""
        packed = self._packed.get("admit")
        if packed is None:
            tail = keyspace.limits_tail([s.script_args() for s in self.scopes])
            packed = self._packed["admit"] = Packed.of(tail)
        return packed


@dataclass(slots=True)
class WindowState:
    """One dimension (requests or tokens) of the tightest scope, for the rate-limit headers."""

    limit: int
    remaining: int
    reset_ms: int


@dataclass(slots=True)
class Admission:
    """A request that was let in; settle it exactly once when it ends."""

    admission_id: str
    limits: RequestLimits
    admitted_at: datetime
    reserved_tokens: int
    backend: Literal["redis", "local", "none"]
    reserved_nano: int = 0
    """The worst-case cost reserved against spend budgets (nano-units)."""
    reserved_prompt: int = 0
    """The prompt's part of ``reserved_tokens``: an estimate until the engine's exact count tops it up."""
    requests: WindowState | None = None
    tokens: WindowState | None = None
    budget_tokens_left: int | None = None
    """What the key's tightest token budget has left after this reservation (None: no budget)."""
    budget_nano_left: int | None = None
    settled: bool = field(default=False)

    @property
    def day(self) -> date:
        """The UTC day it was admitted on: names the budget periods it is counted in."""
        return self.admitted_at.date()

    def headers(self) -> dict[str, str]:
        headers = rate_limit_headers(self.requests, self.tokens)
        if self.budget_tokens_left is not None:
            headers["x-tern-budget-remaining-tokens"] = str(max(0, self.budget_tokens_left))
        if self.budget_nano_left is not None:
            headers["x-tern-budget-remaining-spend"] = nano_str(max(0, self.budget_nano_left))
        return headers


def format_reset(ms: int) -> str:
    """OpenAI's duration style: ``20ms``, ``1.5s``, ``6m0s``."""
    ms = max(0, int(ms))
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest_ms = divmod(ms, 60_000)
    seconds = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


def retry_after_seconds(ms: int) -> str:
    return str(max(1, math.ceil(ms / 1000)))


def rate_limit_headers(requests: WindowState | None, tokens: WindowState | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    for suffix, state in (("requests", requests), ("tokens", tokens)):
        if state is not None:
            headers[f"x-ratelimit-limit-{suffix}"] = str(state.limit)
            headers[f"x-ratelimit-remaining-{suffix}"] = str(max(0, state.remaining))
            headers[f"x-ratelimit-reset-{suffix}"] = format_reset(state.reset_ms)
    return headers


# ---------------------------------------------------------------- admin API bodies


MaxTokens = Annotated[
    PositiveInt32,
    Field(
        description="The max_tokens a request without one gets, and the most any request gets; the key's "
        "value wins over its tenant's; null: TERN_LIMITS_DEFAULT_MAX_TOKENS"
    ),
]


class ModelLimit(BaseModel):
    """One model's limits, named as a tenant's and a key's are. ``rpm``, ``tpm`` and ``concurrency``,
    the names this shipped with, are still accepted (and rows stored with them still read)."""

    model_config = ConfigDict(extra="forbid")

    rpm_limit: Int32 | None = Field(None, validation_alias=AliasChoices("rpm_limit", "rpm"))
    tpm_limit: Int32 | None = Field(None, validation_alias=AliasChoices("tpm_limit", "tpm"))
    max_concurrency: Int32 | None = Field(
        None, validation_alias=AliasChoices("max_concurrency", "concurrency")
    )


class TenantLimitsBody(BaseModel):
    """Limits on a whole tenant, across all its keys. ``null`` means unlimited."""

    model_config = ConfigDict(extra="forbid")

    rpm_limit: Int32 | None = None
    tpm_limit: Int32 | None = None
    max_concurrency: Int32 | None = None
    monthly_token_budget: Int64 | None = None
    monthly_spend_budget: Spend | None = None
    max_tokens: MaxTokens | None = None
    model_limits: dict[Name, ModelLimit] = Field(default_factory=dict)


class KeyLimitsBody(BaseModel):
    """Per-key settings beyond the key's own rpm/tpm/concurrency/token budget columns."""

    model_config = ConfigDict(extra="forbid")

    monthly_spend_budget: Spend | None = None
    failure_policy: FailurePolicy | None = Field(None, description="null: the gateway's default")
    max_tokens: MaxTokens | None = None
    model_limits: dict[Name, ModelLimit] = Field(default_factory=dict)


class TenantLimitsOut(TenantLimitsBody):
    model_config = ConfigDict(extra="forbid", from_attributes=True)

    tenant_id: str


class KeyLimitsOut(KeyLimitsBody):
    model_config = ConfigDict(extra="forbid", from_attributes=True)

    key_id: str
