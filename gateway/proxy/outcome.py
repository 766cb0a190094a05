"""What the proxy hands to the domains that watch it, and what it asks of them.

The proxy knows nothing of limits or usage: at start-up ``gateway.wiring`` gives it an
:class:`Admitter` (the limits, asked before any engine work), its :data:`CompletionHook` list
(limits settlement, usage metering), which receive every finished request's :class:`RelayOutcome`,
and a :class:`UsageJournal` that makes a complete answer's usage durable before its last bytes.
Those domains import this module; the proxy imports none of them, so there is no cycle.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from gateway.auth.identity import AuthenticatedKey
from protocol.openai.requests import OpenAIRequest


@dataclass(slots=True)
class RelayOutcome:
    """Everything known about a finished request; what completion hooks receive.

    Token counts come from the engine's final (or error) frame when ``usage_exact``;
    otherwise the engine could not be asked, ``completion_tokens`` counts the
    token ids the gateway saw and ``prompt_tokens`` is 0.
    """

    request_id: str
    endpoint: str
    model: str
    tenant_id: str | None
    key_id: str | None
    stream: bool
    started_at: float
    """Unix time the gateway began dispatching."""
    engine_url: str | None = None
    status: int = 200
    """The HTTP status, or for a stream that failed after it began the error frame's status;
    499 when the client disconnected first."""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    """Of ``completion_tokens``, those a reasoning model spent thinking (billed as completion)."""
    usage_exact: bool = False
    ttft_s: float | None = None
    duration_s: float = 0.0
    error_code: str | None = None
    client_disconnected: bool = False
    end_user: str | None = None
    """The request's OpenAI ``user`` field: who the caller serves, for reports by end user."""
    committed: bool = False
    """The journal took this outcome before the answer's last bytes (``UsageJournal.commit``)."""


CompletionHook = Callable[[RelayOutcome], Awaitable[None]]

CUT_BY_GATEWAY_STATUS = 500
"""The status billed for a request whose answer a crash of the gateway process cut off."""


class UsageJournal(Protocol):
    """Durable usage while the answer is still open (``gateway.usage.hook``): what survives a crash
    of the gateway process."""

    instance_id: str
    """This gateway process: tagged onto each RPC request, so the engine's ledger can name it."""

    async def commit(self, outcome: RelayOutcome) -> None:
        """The answer is complete: return once its usage is on disk. Takes the outcome before its
        first await (the relay may be cancelled while it waits)."""
        ...

    def progress(self, outcome: RelayOutcome) -> None:
        """An unfinished stream's usage so far (estimated): what is billed if the gateway dies now.
        Only for upstreams that keep no usage ledger of their own."""
        ...


TopUp = Callable[[int], Awaitable[Mapping[str, str]]]
"""(the prompt's exact token count) -> the response's limit headers once the reservation covers it;
raises the limits' refusal (``OpenAIError``) when it cannot."""


@dataclass(frozen=True, slots=True)
class PromptSize:
    """What the proxy knows of a request's prompt before admission, from the engines serving it."""

    overhead: int = 0
    """Tokens the model's chat template adds around one empty user message (its engines report or
    were measured to add it): part of the estimate, or of the bound."""
    bounded: bool = False
    """No engine checks a reservation (``openai``-kind upstreams, Tern engines from before): reserve
    a true upper bound (``token_count.prompt_upper_bound``). False: the engine counts the prompt
    before any work and refuses one over what was reserved (:attr:`Admitted.prompt_tokens`)."""


@dataclass(frozen=True, slots=True)
class Admitted:
    """What an admission grants a request."""

    headers: Mapping[str, str]
    """Added to the response (the rate-limit headers)."""
    max_tokens: int | None = None
    """What the request's ``max_tokens`` is lowered to (or set to, when it has none); None: no cap."""
    prompt_tokens: int | None = None
    """The prompt tokens reserved, for the engine to check the prompt against before any work; None:
    nothing to check (no limit counts tokens, or they were reserved from a true bound)."""
    top_up: TopUp | None = None
    """Grows the reservation to the prompt's exact count when the engine says it has more."""


class Admitter(Protocol):
    """Decides, before any engine work, whether a request may run (``gateway.limits.admission``)."""

    async def admit(
        self, *, key: AuthenticatedKey, request: OpenAIRequest, request_id: str, prompt: PromptSize
    ) -> Admitted:
        """Admit, or raise an ``OpenAIError`` (429, 402, 503)."""
        ...

    async def release(self, *, request_id: str, key_id: str) -> None:
        """Free the admission of a request that never reached an engine (its hooks will not run)."""
        ...
