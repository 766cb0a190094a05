"""The per-process fallback used while Redis is unreachable by keys whose policy is fail-open.

Same algorithm as ``scripts/admit.lua`` (sliding logs, slots with expiry) but in memory, with every
rate limit divided by the number of gateway replicas so the fleet as a whole stays near the limit.
Budgets are checked by the caller against the last counts this process saw (or Postgres).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from gateway.limits.denials import Denial
from gateway.limits.schemas import Scope


@dataclass(slots=True)
class _Window:
    log: deque[tuple[float, str]] = field(default_factory=deque)
    tokens: dict[str, int] = field(default_factory=dict)
    total: int = 0
    slots: dict[str, float] = field(default_factory=dict)


def local_share(limit: int | None, replicas: int) -> int | None:
    """This process's part of a fleet-wide limit; at least 1 so a small limit still admits."""
    if limit is None:
        return None
    return max(1, limit // replicas) if limit > 0 else 0


class LocalLimiter:
    def __init__(self, *, window_s: float, slot_ttl_s: float, replicas: int) -> None:
        self.window_s = window_s
        self.slot_ttl_s = slot_ttl_s
        self.replicas = replicas
        self._windows: dict[str, _Window] = {}

    def _prune(self, w: _Window, now: float) -> None:
        cutoff = now - self.window_s
        while w.log and w.log[0][0] <= cutoff:
            _, rid = w.log.popleft()
            w.total -= w.tokens.pop(rid, 0)
        for rid in [rid for rid, expiry in w.slots.items() if expiry <= now]:
            del w.slots[rid]

    def admit(
        self,
        *,
        admission_id: str,
        scopes: tuple[Scope, ...],
        reserve: int,
    ) -> Denial | None:
        """Admit against every scope's rate limits or none (the caller checks budgets)."""
        now = time.monotonic()
        for scope in scopes:
            w = self._windows.setdefault(scope.name, _Window())
            self._prune(w, now)
            rpm = local_share(scope.rpm, self.replicas)
            tpm = local_share(scope.tpm, self.replicas)
            conc = local_share(scope.concurrency, self.replicas)
            if rpm is not None and len(w.log) >= rpm:
                retry = w.log[len(w.log) - rpm][0] + self.window_s - now if rpm > 0 else self.window_s
                return Denial(scope, "rpm", int(retry * 1000))
            if tpm is not None and w.total + reserve > tpm:
                return Denial(scope, "tpm_too_large" if reserve > tpm else "tpm", int(self.window_s * 1000))
            if conc is not None and len(w.slots) >= conc:
                return Denial(scope, "concurrency", 1000)
        for scope in scopes:
            w = self._windows[scope.name]
            w.log.append((now, admission_id))
            w.tokens[admission_id] = reserve
            w.total += reserve
            if scope.concurrency is not None:
                w.slots[admission_id] = now + self.slot_ttl_s
        return None

    def grow(self, *, admission_id: str, scopes: tuple[Scope, ...], tokens: int) -> Denial | None:
        """Raise an admitted request's tokens to ``tokens`` if every tpm share still holds them."""
        now = time.monotonic()
        for scope in scopes:
            w = self._windows.get(scope.name)
            tpm = local_share(scope.tpm, self.replicas)
            if w is None or tpm is None or admission_id not in w.tokens:
                continue
            self._prune(w, now)
            if w.total - w.tokens.get(admission_id, 0) + tokens > tpm:
                return Denial(scope, "tpm_too_large" if tokens > tpm else "tpm", int(self.window_s * 1000))
        self.settle(admission_id=admission_id, scopes=scopes, tokens=tokens, free_slot=False)
        return None

    def settle(
        self, *, admission_id: str, scopes: tuple[Scope, ...], tokens: int, free_slot: bool = True
    ) -> None:
        for scope in scopes:
            w = self._windows.get(scope.name)
            if w is None:
                continue
            reserved = w.tokens.get(admission_id)
            if reserved is not None:
                w.tokens[admission_id] = tokens
                w.total += tokens - reserved
            if free_slot:
                w.slots.pop(admission_id, None)
