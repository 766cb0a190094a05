"""The gateway's Redis contract: every key name, hash field and Lua script call layout, in one place.

Gateways of two versions share one Redis during a rolling upgrade, so what is built here is a wire
format: a name changed here splits the fleet's limits in two. ``tests/gateway/test_keyspace.py``
writes the names out byte for byte, and checks each script's header (``gateway/limits/scripts/*.lua``)
against the argument builders below, whose signatures are the scripts' KEYS/ARGV order.

This module imports nothing from the gateway, so every package that touches these keys (limits,
budgets) names them from here without an import cycle; a budget period's id comes in as a string
(``gateway.budgets.periods.period_id``).

Keys, per scope (``key:<id>``, ``tenant:<id>``, either with ``:model:<name>``):

- ``tern:rl:<scope>:req``: the sliding window's request log (zset: request id -> admitted ms);
- ``tern:rl:<scope>:tok``: its tokens (hash: request id -> tokens, and ``__total``);
- ``tern:rl:<scope>:slots``: concurrency slots (zset: request id -> expiry ms);
- ``tern:bheld:<scope>``: the sums of outstanding budget reservations (hash ``__tok``, ``__spend``);
- ``tern:bheld:<scope>:exp``: those reservations (zset: ``"<id> <tokens> <nano>"`` -> expiry ms);
- ``tern:budget:<scope>:<period id>``: settled usage in one budget period (hash ``tok``, ``spend``).

And per gateway process: ``tern:gw:alive:<instance>`` (``gateway/limits/liveness.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal, TypeVar

Arg = int | str | bytes
T = TypeVar("T")
"""A script's variable tail (the limits of every scope), pre-encoded once per key by the caller."""

ScopeKind = Literal["key", "tenant"]

ALIVE_PREFIX = "tern:gw:alive:"
COUNTER_FIELDS = ("tok", "spend")
"""A budget counter's fields: settled tokens, and spend in nano-units."""
HELD_FIELDS = ("__tok", "__spend")
"""The reservation sums' fields: outstanding tokens and nano-units."""

SCOPE_KEYS = ("requests", "tokens", "slots", "held", "held_exp")
"""The keys every scope passes the per-scope scripts, in their order; one counter per period follows."""
SCOPE_LIMITS = ("rpm", "tpm", "concurrency", "n_periods", "n_budgets")
"""admit.lua's and topup.lua's arguments per scope (-1: no limit); settle.lua's are the last two."""
SETTLE_SCOPE_LIMITS = SCOPE_LIMITS[3:]
BUDGET_LIMITS = ("period_index", "metric", "limit", "alert_at")
"""Every script's arguments per budget, after its scope's."""


# ---------------------------------------------------------------- key names


def scope_name(kind: ScopeKind, owner_id: object, model: str | None = None) -> str:
    """``key:<id>``, ``tenant:<id>``, or either ``:model:<model>``: names every key of a scope."""
    base = f"{kind}:{owner_id}"
    return f"{base}:model:{model}" if model is not None else base


def window_keys(scope: str) -> tuple[str, str, str]:
    """The request log, its tokens, and the concurrency slots."""
    prefix = f"tern:rl:{scope}"
    return f"{prefix}:req", f"{prefix}:tok", f"{prefix}:slots"


def reservation_keys(scope: str) -> tuple[str, str]:
    """The reservation sums and the reservations. (``tern:bres:<scope>``, the names before, held a
    hash entry per request: a gateway of that version keeps its own.)"""
    return f"tern:bheld:{scope}", f"tern:bheld:{scope}:exp"


def counter_key(scope: str, period_id: str) -> str:
    return f"tern:budget:{scope}:{period_id}"


def counter_pattern(scope: str) -> str:
    """Every period's counter of a scope (its per-model scopes' are named apart: ``:model:``)."""
    return f"tern:budget:{scope}:*"


def alive_key(instance_id: str) -> str:
    return ALIVE_PREFIX + instance_id


def scope_keys(scope: str, period_ids: Iterable[str]) -> list[str]:
    """KEYS of one scope for admit.lua, topup.lua and settle.lua: ``SCOPE_KEYS``, then a counter
    per period."""
    return [*window_keys(scope), *reservation_keys(scope), *(counter_key(scope, p) for p in period_ids)]


# ---------------------------------------------------------------- script arguments
# Each builder's parameters are its script's ARGV, in order, named as the script's header names them.


def scope_limit_args(
    *, rpm: int, tpm: int, concurrency: int, n_periods: int, budgets: Sequence[tuple[int, int, int, int]]
) -> list[int]:
    """One scope's part of the limits: ``SCOPE_LIMITS`` (``n_budgets`` counted here), then per budget
    ``BUDGET_LIMITS`` (period index from 1, metric 0 tokens / 1 spend, limit, alert at or -1)."""
    args = [rpm, tpm, concurrency, n_periods, len(budgets)]
    for budget in budgets:
        args += budget
    return args


def limits_tail(scope_args: Sequence[Sequence[int]]) -> list[int]:
    """admit.lua's and topup.lua's tail: the number of scopes, then each one's ``scope_limit_args``."""
    return [len(scope_args), *(a for args in scope_args for a in args)]


def settlement_tail(scope_args: Sequence[Sequence[int]]) -> list[int]:
    """settle.lua's tail: the number of scopes, then each one's limits less its rate limits."""
    return [len(scope_args), *(a for args in scope_args for a in args[3:])]


def admit_argv(
    *,
    request_id: str,
    reserve_tokens: int,
    window_ms: int,
    slot_ttl_ms: int,
    budget_tokens: int,
    budget_nano: int,
    limits: T,
) -> list[Arg | T]:
    return [request_id, reserve_tokens, window_ms, slot_ttl_ms, budget_tokens, budget_nano, limits]


def topup_argv(
    *,
    request_id: str,
    old_tokens: int,
    old_nano: int,
    new_tokens: int,
    new_nano: int,
    window_ms: int,
    slot_ttl_ms: int,
    limits: T,
) -> list[Arg | T]:
    return [request_id, old_tokens, old_nano, new_tokens, new_nano, window_ms, slot_ttl_ms, limits]


def settle_argv(
    *,
    request_id: str,
    actual_tokens: int,
    spend_nano: int,
    reserved_tokens: int,
    reserved_nano: int,
    settlement: T,
) -> list[Arg | T]:
    return [request_id, actual_tokens, spend_nano, reserved_tokens, reserved_nano, settlement]


def reap_keys(*, slots: str) -> list[str]:
    return [slots]


def reap_reservations_keys(*, held: str, held_exp: str) -> list[str]:
    return [held, held_exp]


def reap_argv(*, alive_prefix: str, instance: str) -> list[Arg]:
    """reap.lua's and reap_reservations.lua's: a gateway is alive while ``alive_prefix + id`` is set;
    ``instance`` (the caller) is."""
    return [alive_prefix, instance]
