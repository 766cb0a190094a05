"""Admission and settlement of requests against rate limits, concurrency slots and budgets.

One script call admits a request (``scripts/admit.lua``) and one settles it
(``scripts/settle.lua``); calls made in the same event-loop turn share one pipelined round trip
(:class:`ScriptBatcher`). While Redis is unreachable each key follows its failure policy:
fail-closed answers 503, fail-open uses :class:`LocalLimiter`. Redis is retried every
``redis_retry_s``, so the gateway goes back to the shared limits by itself. Every key and script
argument is built by ``gateway/keyspace.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from datetime import UTC, date, datetime
from decimal import Decimal
from importlib import resources
from typing import Any, NoReturn

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from gateway import keyspace
from gateway.budgets.periods import COUNTER_TTL_S, Period, period_end, period_id, period_start
from gateway.budgets.rules import BudgetRule, to_nano
from gateway.errors import OpenAIError
from gateway.limits.config import LimitsSettings
from gateway.limits.denials import Denial, raise_denial
from gateway.limits.liveness import new_instance_id
from gateway.limits.local import LocalLimiter
from gateway.limits.schemas import Admission, RequestLimits, Scope, WindowState, retry_after_seconds
from gateway.limits.script_batch import Arg, Packed, ScriptBatcher
from gateway.metrics import limit_refusals_by

log = logging.getLogger(__name__)

REDIS_DOWN_ERRORS = (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError)

UsageLoader = Callable[[Scope, date, date | None], Awaitable[tuple[int, Decimal]]]
"""(scope, first day, end day exclusive or None) -> (tokens used, spend) from Postgres: seeds the
budget counters."""
Clock = Callable[[], datetime]
AlertHook = Callable[[Scope, BudgetRule, int, date], Coroutine[Any, Any, None]]
"""(scope, budget, used, a day of the period): a budget just crossed its alert threshold."""
GaugeHook = Callable[[str, float], None]
"""("<scope>:<metric>:<period>", used / limit) after a settlement that moved it by ``GAUGE_STEP`` or
more since it was last set: the used-ratio metric."""
GAUGE_STEP = 0.001
"""Setting a gauge takes a lock; a budget's ratio moves a hair per request, so it is set again only
once it moved by a tenth of a percentage point (a period's start, back near 0, always does)."""


def utc_now() -> datetime:
    return datetime.now(UTC)


def _script(name: str) -> str:
    return resources.files("gateway.limits").joinpath("scripts", name).read_text()


def reserve_tokens(*, prompt_tokens: int, max_tokens: int | None, n: int, default_max_tokens: int) -> int:
    """Prompt plus the completion the request may produce, its max_tokens capped by the default."""
    completion = default_max_tokens if max_tokens is None else min(max_tokens, default_max_tokens)
    return prompt_tokens + completion * max(1, n)


class RateLimiter:
    def __init__(
        self,
        *,
        redis: Redis,
        settings: LimitsSettings,
        load_usage: UsageLoader,
        clock: Clock = utc_now,
        on_alert: AlertHook | None = None,
        on_used: GaugeHook | None = None,
        instance_id: str | None = None,
    ) -> None:
        self.redis = redis
        self.settings = settings
        self.load_usage = load_usage
        self.clock = clock
        """Names the budget periods (tests move it); the windows use Redis's own clock."""
        self.on_alert = on_alert
        self.on_used = on_used
        self.instance_id = instance_id or new_instance_id()
        """Starts every admission id, so slots of a dead process can be told apart (liveness.py)."""
        self.local = LocalLimiter(
            window_s=settings.window_s, slot_ttl_s=settings.slot_ttl_s, replicas=settings.replicas
        )
        self._admit = redis.register_script(_script("admit.lua"))
        self._settle = redis.register_script(_script("settle.lua"))
        self._reap = redis.register_script(_script("reap.lua"))
        self._reap_reservations = redis.register_script(_script("reap_reservations.lua"))
        self._topup = redis.register_script(_script("topup.lua"))
        self._scripts = ScriptBatcher(redis)
        self._redis_down_until = 0.0
        self._budget_seen: dict[tuple[str, date], int] = {}
        """("<scope>:<metric>:<period>", a day of the period) -> usage last seen (tokens, or nano):
        what the fail-open fallback checks budgets against."""
        self._alerts: set[asyncio.Task[None]] = set()
        self._gauged: dict[str, float] = {}
        """The used ratio last set per budget label (``GAUGE_STEP``)."""

    # ------------------------------------------------------------ Redis health

    @property
    def redis_ok(self) -> bool:
        return time.monotonic() >= self._redis_down_until

    def _mark_redis_down(self, exc: BaseException) -> None:
        if self.redis_ok:
            log.warning("redis unreachable for limits, using failure policies: %s", exc)
        self._redis_down_until = time.monotonic() + self.settings.redis_retry_s

    # ------------------------------------------------------------ admission

    async def admit(
        self, *, limits: RequestLimits, reserve: int, reserve_nano: int = 0, now: datetime | None = None
    ) -> Admission:
        """Admit the request or raise an OpenAI-shaped 429/402/503, before any engine work.

        ``reserve`` tokens count against the tpm windows and every token budget, ``reserve_nano``
        (the worst-case cost) against every spend budget, until the request settles; ``now`` (default:
        the clock) names the budget periods.
        """
        now = now or self.clock()
        admission = Admission(
            admission_id=f"{self.instance_id}.{os.urandom(16).hex()}",  # as uuid4().hex, cheaper
            limits=limits,
            admitted_at=now,
            reserved_tokens=reserve,
            reserved_nano=reserve_nano,
            backend="none",
        )
        if not self.settings.enabled or not any(s.is_limited for s in limits.scopes):
            return admission
        if self.redis_ok:
            try:
                await self._admit_redis(admission)
                admission.backend = "redis"
                return admission
            except REDIS_DOWN_ERRORS as exc:
                self._mark_redis_down(exc)
        if limits.failure_policy == "closed":
            self._refuse_unavailable()
        await self._admit_local(admission)
        admission.backend = "local"
        return admission

    def _refuse_unavailable(self) -> NoReturn:
        limit_refusals_by("limiter_unavailable").inc()
        raise OpenAIError(
            503,
            "Rate limiting is temporarily unavailable and this API key is configured to fail closed; "
            "retry shortly.",
            code="rate_limiter_unavailable",
            headers={"retry-after": retry_after_seconds(int(self.settings.redis_retry_s * 1000))},
        )

    async def _admit_redis(self, admission: Admission) -> None:
        args = keyspace.admit_argv(
            request_id=admission.admission_id,
            reserve_tokens=admission.reserved_tokens,
            window_ms=int(self.settings.window_s * 1000),
            slot_ttl_ms=int(self.settings.slot_ttl_s * 1000),
            budget_tokens=admission.reserved_tokens,
            budget_nano=admission.reserved_nano,
            limits=admission.limits.limit_args(),
        )
        await self._run_admit_script(self._admit, admission, args, admission)

    async def _run_admit_script(
        self, script: AsyncScript, admission: Admission, args: list[Arg | Packed], asked: Admission
    ) -> None:
        """Run admit.lua or topup.lua (one reply shape) to "ok", seeding counters and freeing a dead
        gateway's slots as they ask; a denial raises, naming what ``asked`` reserves."""
        scopes = admission.limits.scopes
        keys = admission.limits.redis_keys(admission.day)
        reaped: set[int] = set()
        for _ in range(admission.limits.script_tries):
            reply = await self._scripts.call(script, keys=keys, args=args)
            fields: list[bytes] = reply.split()  # type: ignore[attr-defined]  # admit.lua's reply
            outcome = fields[0]
            if outcome == b"seed":
                scope = scopes[int(fields[1]) - 1]
                await self._seed_counter(scope, scope.periods[int(fields[2]) - 1], admission.day)
                continue
            if outcome == b"deny":
                index = int(fields[1]) - 1
                scope = scopes[index]
                if fields[2] in (b"concurrency", b"token_budget", b"spend_budget") and index not in reaped:
                    reaped.add(index)
                    if await self._reap_dead(admission, index, fields[2] == b"concurrency"):
                        continue  # slots or reservations of a dead gateway were holding it: try again
                budget = scope.budgets[int(fields[4]) - 1] if fields[2].endswith(b"_budget") else None
                denial = Denial(scope, fields[2].decode(), int(fields[3]), budget)
                raise_denial(denial, asked, self.settings)
            self._read_ok(fields, admission)
            return
        raise RuntimeError("budget counters could not be seeded")  # pragma: no cover

    async def top_up(self, admission: Admission, *, tokens: int, nano: int) -> None:
        """Grow an admitted request's reservation to ``tokens`` (``nano``): its exact worst case, once
        the engine counted its prompt. Raises the refusal admission would have given it, leaving the
        admission as it was (settle it to give that back)."""
        grown = replace(admission, reserved_tokens=tokens, reserved_nano=nano)
        if admission.backend == "redis":
            args = keyspace.topup_argv(
                request_id=admission.admission_id,
                old_tokens=admission.reserved_tokens,
                old_nano=admission.reserved_nano,
                new_tokens=tokens,
                new_nano=nano,
                window_ms=int(self.settings.window_s * 1000),
                slot_ttl_ms=int(self.settings.slot_ttl_s * 1000),
                limits=admission.limits.limit_args(),
            )
            shown = (admission.tokens, admission.budget_tokens_left, admission.budget_nano_left)
            admission.tokens = admission.budget_tokens_left = admission.budget_nano_left = None
            try:
                await self._run_admit_script(self._topup, admission, args, grown)
            except REDIS_DOWN_ERRORS as exc:  # lost since admission: as admission would do now
                self._mark_redis_down(exc)
                admission.tokens, admission.budget_tokens_left, admission.budget_nano_left = shown
                if admission.limits.failure_policy == "closed":
                    self._refuse_unavailable()
                await self._admit_local_budgets(grown)
        elif admission.backend == "local":
            await self._admit_local_budgets(grown)
            denial = self.local.grow(
                admission_id=admission.admission_id, scopes=admission.limits.scopes, tokens=tokens
            )
            if denial is not None:
                raise_denial(denial, grown, self.settings)
        admission.reserved_tokens, admission.reserved_nano = tokens, nano

    async def _reap_dead(self, admission: Admission, index: int, slots: bool) -> int:
        """Free the scope's concurrency slots (``slots``), else its budget reservations, whose gateway
        process died; how many were freed."""
        scope = admission.limits.scopes[index].name
        args = keyspace.reap_argv(alive_prefix=keyspace.ALIVE_PREFIX, instance=self.instance_id)
        if slots:
            keys = keyspace.reap_keys(slots=keyspace.window_keys(scope)[2])
            freed = int(await self._reap(keys=keys, args=args))
        else:
            held, held_exp = keyspace.reservation_keys(scope)
            keys = keyspace.reap_reservations_keys(held=held, held_exp=held_exp)
            freed = int(await self._reap_reservations(keys=keys, args=args))
        if freed:
            what = "concurrency slots" if slots else "budget reservations"
            log.warning("freed %d %s of dead gateways on %s", freed, what, scope)
        return freed

    def _read_ok(self, fields: list[bytes], admission: Admission) -> None:
        limits = admission.limits
        for at in limits.window_fields:
            rpm, req_left, req_reset, tpm, tok_left, tok_reset = (int(v) for v in fields[at : at + 6])
            if rpm >= 0 and (admission.requests is None or req_left < admission.requests.remaining):
                admission.requests = WindowState(rpm, req_left, req_reset)
            if tpm >= 0 and (admission.tokens is None or tok_left < admission.tokens.remaining):
                admission.tokens = WindowState(tpm, tok_left, tok_reset)
        for at in limits.key_token_fields:
            left = int(fields[at])
            if admission.budget_tokens_left is None or left < admission.budget_tokens_left:
                admission.budget_tokens_left = left
        for at in limits.key_spend_fields:
            left = int(fields[at])
            if admission.budget_nano_left is None or left < admission.budget_nano_left:
                admission.budget_nano_left = left

    async def _seed_counter(self, scope: Scope, period: Period, day: date) -> None:
        """Start a period's counter from Postgres (Redis lost it, or the period just began)."""
        tokens, spend = await self.load_usage(scope, period_start(period, day), period_end(period, day))
        key = keyspace.counter_key(scope.name, period_id(period, day))
        tok_field, spend_field = keyspace.COUNTER_FIELDS
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(key, tok_field, tokens)
            pipe.hsetnx(key, spend_field, to_nano(spend))
            ttl_s = COUNTER_TTL_S[period]
            if ttl_s is not None:
                pipe.expire(key, ttl_s)
            await pipe.execute()

    async def _admit_local(self, admission: Admission) -> None:
        """Fail-open: rate limits from the local share, budgets against the last counts seen."""
        await self._admit_local_budgets(admission)
        denial = self.local.admit(
            admission_id=admission.admission_id,
            scopes=admission.limits.scopes,
            reserve=admission.reserved_tokens,
        )
        if denial is not None:
            raise_denial(denial, admission, self.settings)

    async def _admit_local_budgets(self, admission: Admission) -> None:
        """Fail-open budgets: the request's worst case against the last counts this process saw."""
        for slot in admission.limits.budgets:
            scope, budget = slot.scope, slot.rule
            key = (slot.label, admission.day)
            if key not in self._budget_seen:
                try:
                    start = period_start(budget.period, admission.day)
                    tokens, spend = await self.load_usage(scope, start, period_end(budget.period, start))
                    self._budget_seen[key] = tokens if budget.metric == "tokens" else to_nano(spend)
                except Exception as exc:  # Postgres may be down too; rate limits still hold
                    log.warning("cannot load budget usage for %s: %s", scope.name, exc)
            used = self._budget_seen.get(key, 0)
            need = admission.reserved_tokens if budget.metric == "tokens" else admission.reserved_nano
            if used + need > budget.limit:
                reason = "token_budget" if budget.metric == "tokens" else "spend_budget"
                raise_denial(Denial(scope, reason, 0, budget), admission, self.settings)

    # ------------------------------------------------------------ settlement

    async def settle(self, admission: Admission, *, tokens: int, spend_nano: int = 0) -> None:
        """Replace the reservations by the real usage (tokens, and cost in nano-units) and free the
        slot (idempotent)."""
        if admission.settled:
            return
        admission.settled = True
        scopes = admission.limits.scopes
        if admission.backend == "local":
            self.local.settle(admission_id=admission.admission_id, scopes=scopes, tokens=tokens)
            self._count_budget_locally(admission, tokens, spend_nano)
            return
        if admission.backend != "redis":
            return
        keys = admission.limits.redis_keys(admission.day)
        try:
            args = keyspace.settle_argv(
                request_id=admission.admission_id,
                actual_tokens=tokens,
                spend_nano=spend_nano,
                reserved_tokens=admission.reserved_tokens,  # with the id, they name the reservation
                reserved_nano=admission.reserved_nano,
                settlement=admission.limits.settle_args(),
            )
            reply = await self._scripts.call(self._settle, keys=keys, args=args)
        except REDIS_DOWN_ERRORS as exc:  # the reservations and the slot expire on their own
            self._mark_redis_down(exc)
            self._count_budget_locally(admission, tokens, spend_nano)
            return
        self._after_settle(admission, reply.split())  # type: ignore[attr-defined]  # settle.lua's reply

    def _after_settle(self, admission: Admission, fields: list[bytes]) -> None:
        day = admission.day
        for j, budget in enumerate(admission.limits.budgets):
            used = int(fields[2 * j])
            if used < 0:  # no counter (Redis lost it): the next admission seeds it
                continue
            self._budget_seen[(budget.label, day)] = used
            if self.on_used is not None:
                ratio = used / budget.rule.limit if budget.rule.limit else 1.0
                if abs(ratio - self._gauged.get(budget.label, -1.0)) >= GAUGE_STEP:
                    if len(self._gauged) > 100_000:  # many keys come and go
                        self._gauged.clear()
                    self._gauged[budget.label] = ratio
                    self.on_used(budget.label, ratio)
            if fields[2 * j + 1] == b"1" and self.on_alert is not None:
                task = asyncio.get_running_loop().create_task(
                    self.on_alert(budget.scope, budget.rule, used, day)
                )
                self._alerts.add(task)
                task.add_done_callback(self._alerts.discard)

    def _count_budget_locally(self, admission: Admission, tokens: int, spend_nano: int) -> None:
        for budget in admission.limits.budgets:
            key = (budget.label, admission.day)
            seen = self._budget_seen.get(key)
            if seen is not None:
                self._budget_seen[key] = seen + (tokens if budget.rule.metric == "tokens" else spend_nano)

    async def drain_alerts(self) -> None:
        """Wait for the alerts being sent (shutdown, tests)."""
        while self._alerts:
            await asyncio.gather(*self._alerts, return_exceptions=True)
