"""Admission and settlement of requests against rate limits, concurrency slots and budgets.

One script call admits a request (``scripts/admit.lua``) and one settles it
(``scripts/settle.lua``); calls made in the same event-loop turn share one pipelined round trip
(:class:`ScriptBatcher`). While Redis is unreachable each key follows its failure policy:
fail-closed answers 503, fail-open uses :class:`LocalLimiter`. Redis is retried every
``redis_retry_s``, so the gateway goes back to the shared limits by itself.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, date, datetime
from decimal import Decimal
from importlib import resources

from redis import exceptions as redis_errors
from redis.asyncio import Redis

from gateway.errors import OpenAIError
from gateway.limits.config import LimitsSettings
from gateway.limits.liveness import ALIVE_PREFIX, new_instance_id
from gateway.limits.local import Denial, LocalLimiter
from gateway.limits.schemas import (
    Admission,
    RequestLimits,
    Scope,
    WindowState,
    rate_limit_headers,
    retry_after_seconds,
    to_nano,
)
from gateway.limits.script_batch import ScriptBatcher
from gateway.metrics import limit_refusals_by

log = logging.getLogger(__name__)

REDIS_DOWN_ERRORS = (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError)

MonthUsageLoader = Callable[[Scope, date], Awaitable[tuple[int, Decimal]]]
"""(scope, first day of month) -> (tokens used, spend) from Postgres: seeds the budget counters."""


def _script(name: str) -> str:
    return resources.files("gateway.limits").joinpath("scripts", name).read_text()


def month_of(now: datetime) -> str:
    return f"{now.year:04d}{now.month:02d}"


def month_start(month: str) -> date:
    return date(int(month[:4]), int(month[4:]), 1)


def seconds_to_next_month(now: datetime) -> int:
    nxt = datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=UTC)
    return max(1, int((nxt - now).total_seconds()))


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
        load_month_usage: MonthUsageLoader,
        instance_id: str | None = None,
    ) -> None:
        self.redis = redis
        self.settings = settings
        self.load_month_usage = load_month_usage
        self.instance_id = instance_id or new_instance_id()
        """Starts every admission id, so slots of a dead process can be told apart (liveness.py)."""
        self.local = LocalLimiter(
            window_s=settings.window_s, slot_ttl_s=settings.slot_ttl_s, replicas=settings.replicas
        )
        self._admit = redis.register_script(_script("admit.lua"))
        self._settle = redis.register_script(_script("settle.lua"))
        self._reap = redis.register_script(_script("reap.lua"))
        self._scripts = ScriptBatcher(redis)
        self._redis_down_until = 0.0
        self._budget_seen: dict[tuple[str, str], tuple[int, int]] = {}

    # ------------------------------------------------------------ Redis health

    @property
    def redis_ok(self) -> bool:
        return time.monotonic() >= self._redis_down_until

    def _mark_redis_down(self, exc: BaseException) -> None:
        if self.redis_ok:
            log.warning("redis unreachable for limits, using failure policies: %s", exc)
        self._redis_down_until = time.monotonic() + self.settings.redis_retry_s

    # ------------------------------------------------------------ admission

    async def admit(self, *, limits: RequestLimits, reserve: int) -> Admission:
        """Admit the request or raise an OpenAI-shaped 429/402/503, before any engine work."""
        now = datetime.now(UTC)
        month = month_of(now)
        admission = Admission(
            admission_id=f"{self.instance_id}.{uuid.uuid4().hex}",
            limits=limits,
            month=month,
            reserved_tokens=reserve,
            backend="none",
        )
        if not self.settings.enabled or not any(s.is_limited for s in limits.scopes):
            return admission
        if self.redis_ok:
            try:
                await self._admit_redis(admission, now)
                admission.backend = "redis"
                return admission
            except REDIS_DOWN_ERRORS as exc:
                self._mark_redis_down(exc)
        if limits.failure_policy == "closed":
            limit_refusals_by("limiter_unavailable").inc()
            raise OpenAIError(
                503,
                "Rate limiting is temporarily unavailable and this API key is configured to fail closed; "
                "retry shortly.",
                code="rate_limiter_unavailable",
                headers={"retry-after": retry_after_seconds(int(self.settings.redis_retry_s * 1000))},
            )
        await self._admit_local(admission, now)
        admission.backend = "local"
        return admission

    async def _admit_redis(self, admission: Admission, now: datetime) -> None:
        scopes = admission.limits.scopes
        keys = admission.limits.redis_keys(admission.month)
        args: list[int | str | bytes] = [
            admission.admission_id,
            admission.reserved_tokens,
            int(self.settings.window_s * 1000),
            int(self.settings.slot_ttl_s * 1000),
            *admission.limits.limit_args(),  # the number of scopes, then their limits
        ]
        reaped: set[int] = set()
        for _ in range(2 * len(scopes) + 1):
            reply = await self._scripts.call(self._admit, keys=keys, args=args)
            fields: list[bytes] = reply.split()  # type: ignore[attr-defined]  # admit.lua's reply
            outcome = fields[0]
            if outcome == b"seed":
                await self._seed_budget(scopes[int(fields[1]) - 1], admission.month)
                continue
            if outcome == b"deny":
                index = int(fields[1]) - 1
                reason = fields[2].decode()
                if reason == "concurrency" and index not in reaped:
                    reaped.add(index)
                    if await self._reap_dead_slots(admission, index):
                        continue  # slots of a dead gateway were holding the key: try again
                self._raise_denial(Denial(scopes[index], reason, int(fields[3])), admission, now)
            self._read_ok(fields, admission)
            return
        raise RuntimeError("budget counters could not be seeded")  # pragma: no cover

    async def _reap_dead_slots(self, admission: Admission, index: int) -> int:
        """Free the scope's concurrency slots whose gateway process died; how many were freed."""
        slots_key = admission.limits.scopes[index].redis_keys(admission.month)[2]
        freed = int(await self._reap(keys=[slots_key], args=[ALIVE_PREFIX, self.instance_id]))
        if freed:
            log.warning("freed %d concurrency slots of dead gateways on %s", freed, slots_key)
        return freed

    def _read_ok(self, fields: list[bytes], admission: Admission) -> None:
        for i, scope in enumerate(admission.limits.scopes):
            rpm, req_left, req_reset, tpm, tok_left, tok_reset, tok_used, spend_used = (
                int(v) for v in fields[2 + 8 * i : 10 + 8 * i]
            )
            if rpm >= 0 and (admission.requests is None or req_left < admission.requests.remaining):
                admission.requests = WindowState(rpm, req_left, req_reset)
            if tpm >= 0 and (admission.tokens is None or tok_left < admission.tokens.remaining):
                admission.tokens = WindowState(tpm, tok_left, tok_reset)
            if scope.has_budget:
                self._budget_seen[(scope.name, admission.month)] = (tok_used, spend_used)

    async def _seed_budget(self, scope: Scope, month: str) -> None:
        """Start this month's counters from Postgres (Redis lost them, or the month just began)."""
        tokens, spend = await self.load_month_usage(scope, month_start(month))
        key = scope.redis_keys(month)[3]
        ttl_s = 40 * 86400
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(key, "tok", tokens)
            pipe.hsetnx(key, "spend", to_nano(spend))
            pipe.expire(key, ttl_s)
            await pipe.execute()

    async def _admit_local(self, admission: Admission, now: datetime) -> None:
        used: dict[str, tuple[int, int]] = {}
        for scope in admission.limits.scopes:
            if not scope.has_budget:
                continue
            seen_key = (scope.name, admission.month)
            if seen_key not in self._budget_seen:
                try:
                    tokens, spend = await self.load_month_usage(scope, month_start(admission.month))
                    self._budget_seen[seen_key] = (tokens, to_nano(spend))
                except Exception as exc:  # Postgres may be down too; rate limits still hold
                    log.warning("cannot load month usage for %s: %s", scope.name, exc)
            used[scope.name] = self._budget_seen.get(seen_key, (0, 0))
        denial = self.local.admit(
            admission_id=admission.admission_id,
            scopes=admission.limits.scopes,
            reserve=admission.reserved_tokens,
            budget_used=used,
        )
        if denial is not None:
            self._raise_denial(denial, admission, now)

    def _raise_denial(self, denial: Denial, admission: Admission, now: datetime) -> None:
        limit_refusals_by(denial.reason).inc()
        scope, reserve = denial.scope, admission.reserved_tokens
        retry = retry_after_seconds(denial.retry_after_ms)
        if denial.reason in ("rpm", "tpm"):
            exhausted = WindowState(
                (scope.rpm if denial.reason == "rpm" else scope.tpm) or 0, 0, denial.retry_after_ms
            )
            if denial.reason == "rpm":
                headers = rate_limit_headers(exhausted, None)
                what = f"{scope.rpm} requests per minute"
            else:
                headers = rate_limit_headers(None, exhausted)
                what = (
                    f"{scope.tpm} tokens per minute; this request reserves {reserve} tokens "
                    "(prompt plus max_tokens)"
                )
            message = f"Rate limit reached for {scope.label}: {what}. Try again in {retry} s."
            raise OpenAIError(
                429, message, code="rate_limit_exceeded", headers={"retry-after": retry, **headers}
            )
        if denial.reason == "tpm_too_large":
            message = (
                f"Request too large for {scope.label}: it reserves {reserve} tokens (prompt plus max_tokens) "
                f"but the limit is {scope.tpm} tokens per minute. Lower max_tokens or shorten the prompt."
            )
            raise OpenAIError(400, message, param="max_tokens", code="tokens_exceed_rate_limit")
        if denial.reason == "concurrency":
            message = (
                f"Too many concurrent requests for {scope.label}: at most {scope.concurrency} at a time. "
                "Try again when one finishes."
            )
            raise OpenAIError(429, message, code="concurrency_limit_exceeded", headers={"retry-after": retry})
        reset = seconds_to_next_month(now)
        if denial.reason == "token_budget":
            what = f"monthly token budget of {scope.monthly_tokens} tokens"
        else:
            what = f"monthly spend budget of {scope.monthly_spend}"
        message = f"The {what} for {scope.label} is used up; it resets at the start of next month (UTC)."
        raise OpenAIError(
            self.settings.budget_status,
            message,
            code="insufficient_quota",
            type="insufficient_quota",
            headers={"retry-after": str(reset)},
        )

    # ------------------------------------------------------------ settlement

    async def settle(self, admission: Admission, *, tokens: int, spend: Decimal = Decimal(0)) -> None:
        """Replace the reservation by the real token count and free the slot (idempotent)."""
        if admission.settled:
            return
        admission.settled = True
        scopes = admission.limits.scopes
        if admission.backend == "local":
            self.local.settle(admission_id=admission.admission_id, scopes=scopes, tokens=tokens)
            self._count_budget_locally(admission, tokens, spend)
            return
        if admission.backend != "redis":
            return
        keys = admission.limits.redis_keys(admission.month)
        try:
            args = [admission.admission_id, tokens, to_nano(spend) if spend else 0, len(scopes)]
            await self._scripts.call(self._settle, keys=keys, args=args)
        except REDIS_DOWN_ERRORS as exc:  # the reservation and the slot expire on their own
            self._mark_redis_down(exc)
        self._count_budget_locally(admission, tokens, spend)

    def _count_budget_locally(self, admission: Admission, tokens: int, spend: Decimal) -> None:
        spend_nano = to_nano(spend) if spend else 0
        for scope in admission.limits.scopes:
            if not scope.has_budget:
                continue
            seen_key = (scope.name, admission.month)
            seen = self._budget_seen.get(seen_key)
            if seen is not None:
                self._budget_seen[seen_key] = (seen[0] + tokens, seen[1] + spend_nano)
