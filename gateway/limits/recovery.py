"""After a gateway process died: free what it held and make the budget counters equal the rows again.

The usage domain replays a dead process's journal (and bills the streams it cut from the engines'
ledgers); then :class:`LimitsRecovery` (one of its recovery hooks) deletes the dead processes'
liveness keys, so their concurrency slots are freed at the next refusal (``liveness.py``), and
drops the budget counters (every period) of every tenant and key the replay stored new rows for. The
next admission seeds them again from Postgres (``admit.lua``'s ``seed``), which now holds those
rows: a request the dead process had counted, or had not yet counted, is in them exactly once.
Reservations in the per-minute windows leave with the window on their own; a dead process's budget
reservations are given back at the next budget refusal of their scope (``reap_reservations.lua``), or
expire after ``TERN_LIMITS_SLOT_TTL_S``.
"""

from __future__ import annotations

import logging

from redis.asyncio import Redis

from gateway.keyspace import counter_pattern
from gateway.limits.liveness import Liveness
from gateway.limits.schemas import Scope
from gateway.usage.recorder import Recovered

log = logging.getLogger(__name__)


def budget_key_patterns(*, tenant_ids: set[str], key_ids: set[str]) -> list[str]:
    """Redis patterns of every budget counter (every period) of these tenants and keys (their
    per-model ones too)."""
    scopes = [Scope(kind="tenant", id=t, label="") for t in sorted(tenant_ids)]
    scopes += [Scope(kind="key", id=k, label="") for k in sorted(key_ids)]
    return [counter_pattern(scope.name) for scope in scopes]


class LimitsRecovery:
    def __init__(self, *, redis: Redis, liveness: Liveness) -> None:
        self.redis = redis
        self.liveness = liveness

    async def __call__(self, recovered: Recovered) -> None:
        await self.liveness.forget(recovered.instances)
        if not recovered.new:
            return
        patterns = budget_key_patterns(
            tenant_ids={r.tenant_id for r in recovered.records},
            key_ids={r.key_id for r in recovered.records},
        )
        dropped = 0
        for pattern in patterns:
            keys = [key async for key in self.redis.scan_iter(match=pattern, count=1000)]
            if keys:
                dropped += int(await self.redis.delete(*keys))
        log.info("budget counters reseed from Postgres after a recovery: %d dropped", dropped)
