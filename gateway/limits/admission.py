"""Limits on the /v1 path: admit before dispatch, settle from the proxy's completion hook.

:class:`RequestLimiter` is the proxy's ``Admitter`` (``gateway.proxy.outcome``): the proxy calls
:meth:`RequestLimiter.admit` after authentication and before any engine work and adds the headers it
returns to its response; :meth:`RequestLimiter.on_complete` runs as a completion hook with the
request's real usage. A request that fails before its relay exists is released by
:meth:`RequestLimiter.release` (settling is idempotent, so releasing twice is harmless).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from datetime import UTC, date, datetime
from functools import partial
from typing import NamedTuple

from gateway.auth.identity import AuthenticatedKey
from gateway.budgets.rules import PRICE_SCALE, nano_cost
from gateway.limits.denials import TokensRefused
from gateway.limits.limiter import RateLimiter, reserve_tokens
from gateway.limits.policies import LimitPolicies
from gateway.limits.schemas import Admission, RequestLimits
from gateway.proxy.outcome import Admitted, PromptSize, RelayOutcome
from gateway.proxy.token_count import prompt_upper_bound
from gateway.reports.pricing import PriceBook
from protocol.openai.requests import ChatCompletionRequest, OpenAIRequest

BYTES_PER_TOKEN = 4
"""A prompt is estimated at 4 bytes a token (plus its template's tokens) for the reservation; the
engine checks the estimate against the exact count before any work (``_top_up``)."""


def estimate_prompt_tokens(request: OpenAIRequest) -> int:
    if isinstance(request, ChatCompletionRequest):
        size = 0
        for message in request.messages:
            content = message.content
            if isinstance(content, str):
                size += len(content.encode())
            elif content is not None:
                size += sum(len(str(getattr(part, "text", "") or "").encode()) for part in content)
        return math.ceil(size / BYTES_PER_TOKEN) + 4 * len(request.messages)
    prompt = request.prompt
    if isinstance(prompt, str):
        return math.ceil(len(prompt.encode()) / BYTES_PER_TOKEN)
    if prompt and isinstance(prompt[0], int):
        return len(prompt)
    return sum(
        len(p) if isinstance(p, list) else math.ceil(len(str(p).encode()) / BYTES_PER_TOKEN) for p in prompt
    )


class ScaledPrice(NamedTuple):
    """A model's prices per million tokens times ``PRICE_SCALE``: integers, so costs are exact."""

    prompt: int
    cached_prompt: int
    completion: int
    dearer_prompt: int
    """The dearer of the prompt and cached prices: what a worst case prices every prompt token at."""


class RequestLimiter:
    def __init__(self, *, limiter: RateLimiter, policies: LimitPolicies, prices: PriceBook) -> None:
        self.limiter = limiter
        self.policies = policies
        self.prices = prices
        self._inflight: dict[tuple[str, str], list[Admission]] = defaultdict(list)
        self._scaled_prices: dict[tuple[str, date], ScaledPrice | None] = {}
        self._price_version = -1

    async def admit(
        self,
        *,
        key: AuthenticatedKey,
        request: OpenAIRequest,
        request_id: str,
        prompt: PromptSize = PromptSize(),  # noqa: B008  # frozen
    ) -> Admitted:
        """Admit or raise a 429/402/503 OpenAIError (with retry-after) before any engine work; the
        rate-limit headers for the response and the request's ``max_tokens`` cap (the key's, else
        its tenant's ``max_tokens`` setting, else ``TERN_LIMITS_DEFAULT_MAX_TOKENS``).

        The prompt is reserved at a true upper bound when ``prompt.bounded`` (the engine cannot check
        a reservation), else at an estimate that the engine checks against the exact count before any work
        (:meth:`_top_up`). An estimate is never what refuses a request: one its estimate does not
        fit is admitted, if at all, on 0 prompt tokens, and its exact count then decides."""
        limits = await self.policies.for_request(key=key, model=request.model)
        cap = limits.max_tokens or self.limiter.settings.default_max_tokens
        estimated = not prompt.bounded and limits.counts_tokens
        if prompt.bounded:
            prompt_tokens = prompt_upper_bound(request, prompt.overhead) if limits.counts_tokens else 0
        else:
            prompt_tokens = estimate_prompt_tokens(request)
            if isinstance(request, ChatCompletionRequest):
                prompt_tokens += prompt.overhead
        now = self.limiter.clock()
        try:
            admission = await self._reserve(limits, request, cap, prompt_tokens, now)
        except TokensRefused:
            if not estimated or prompt_tokens == 0:
                raise
            admission = await self._reserve(limits, request, cap, 0, now)
        self._inflight[(request_id, str(key.key_id))].append(admission)
        if not estimated or admission.backend == "none":
            return Admitted(headers=admission.headers(), max_tokens=cap)
        return Admitted(
            headers=admission.headers(),
            max_tokens=cap,
            prompt_tokens=admission.reserved_prompt,
            top_up=partial(self._top_up, admission, request.model),
        )

    async def _reserve(
        self, limits: RequestLimits, request: OpenAIRequest, cap: int, prompt_tokens: int, now: datetime
    ) -> Admission:
        """Admit on ``prompt_tokens`` plus the completion the request may produce."""
        reserve = reserve_tokens(
            prompt_tokens=prompt_tokens,
            max_tokens=request.requested_max_tokens,
            n=request.n,
            default_max_tokens=cap,
        )
        reserve_nano = 0
        if limits.has_spend_budget:
            reserve_nano = await self._worst_cost(
                request.model, now.date(), prompt_tokens, reserve - prompt_tokens
            )
        admission = await self.limiter.admit(
            limits=limits, reserve=reserve, reserve_nano=reserve_nano, now=now
        )
        admission.reserved_prompt = prompt_tokens
        return admission

    async def _top_up(self, admission: Admission, model: str, prompt_tokens: int) -> Mapping[str, str]:
        """The engine counted the prompt at ``prompt_tokens``, more than reserved: reserve its exact
        worst case (one script call) or raise the refusal admission would have given. The new
        limit headers."""
        if prompt_tokens > admission.reserved_prompt and not admission.settled:
            completion = admission.reserved_tokens - admission.reserved_prompt
            nano = admission.reserved_nano
            if admission.limits.has_spend_budget:
                nano = await self._worst_cost(model, admission.day, prompt_tokens, completion)
            await self.limiter.top_up(admission, tokens=prompt_tokens + completion, nano=nano)
            admission.reserved_prompt = prompt_tokens
        return admission.headers()

    async def _price(self, model: str, day: date) -> ScaledPrice | None:
        """The model's prices on that day as integers (``PRICE_SCALE``), worked out once per model,
        day and load of the prices, not per request."""
        book = self.prices
        if book.due():
            try:
                await book.refresh()
            except Exception:  # Postgres down: the last prices loaded still apply
                pass
        if self._price_version != book.version:
            self._price_version = book.version
            self._scaled_prices.clear()
        try:
            return self._scaled_prices[(model, day)]
        except KeyError:
            pass
        price = book.price(model, day)
        scaled = None
        if price is not None:
            prompt, cached, completion = (
                int(p * PRICE_SCALE) for p in (price.prompt, price.cached_prompt, price.completion)
            )
            scaled = ScaledPrice(prompt, cached, completion, max(prompt, cached))
        if len(self._scaled_prices) > 1000:  # many (possibly bogus) model names
            self._scaled_prices.clear()
        self._scaled_prices[(model, day)] = scaled
        return scaled

    async def _worst_cost(self, model: str, day: date, prompt_tokens: int, completion_tokens: int) -> int:
        """The most the request can cost (nano-units): every prompt token at the dearer of the prompt
        and cached prices, every completion token it may produce at the completion price."""
        price = await self._price(model, day)
        if price is None:
            return 0
        return nano_cost(
            price.dearer_prompt,
            price.dearer_prompt,
            price.completion,
            prompt=prompt_tokens,
            cached=0,
            completion=completion_tokens,
        )

    def _take(self, request_id: str, key_id: str | None) -> Admission | None:
        waiting = self._inflight.get((request_id, str(key_id)))
        if not waiting:
            return None
        admission = waiting.pop(0)
        if not waiting:
            del self._inflight[(request_id, str(key_id))]
        return admission

    async def release(self, *, request_id: str, key_id: str) -> None:
        """Free an admission whose request never reached the relay (refused before dispatch)."""
        admission = self._take(request_id, key_id)
        if admission is not None:
            await self.limiter.settle(admission, tokens=0)

    async def on_complete(self, outcome: RelayOutcome) -> None:
        """Completion hook: settle the reservation with the real tokens and their cost."""
        admission = self._take(outcome.request_id, outcome.key_id)
        if admission is None:
            return
        tokens = outcome.prompt_tokens + outcome.completion_tokens
        spend_nano = 0
        if admission.limits.has_spend_budget:
            day = datetime.fromtimestamp(outcome.started_at, UTC).date()
            price = await self._price(outcome.model, day)
            if price is not None:
                spend_nano = nano_cost(
                    price.prompt,
                    price.cached_prompt,
                    price.completion,
                    prompt=outcome.prompt_tokens,
                    cached=outcome.cached_tokens,
                    completion=outcome.completion_tokens,
                )
        await self.limiter.settle(admission, tokens=tokens, spend_nano=spend_nano)
