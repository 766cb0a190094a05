"""The engine core's own types: what a request asks for and what each step produces.

Plain dataclasses, no pydantic: the core knows nothing of the wire. The serving layer
builds :class:`EngineRequest` from the RPC's ``GenerateRequest`` (``engine/serving/requests.py``)
and turns :class:`RequestOutput` into the RPC's frames (``engine/serving/frames.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from engine.structured.grammar import Grammar
    from engine.structured.tool_calls import ToolCallParser

FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


class ErrorKind(enum.Enum):
    """Why a request is refused; the value is the error code clients see (the server maps it to a status)."""

    INVALID_REQUEST = "invalid_request"
    MODEL_NOT_FOUND = "model_not_found"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    CONFLICT = "conflict"


class RequestError(ValueError):
    """A request the engine refuses before doing any work."""

    def __init__(
        self, message: str, *, kind: ErrorKind = ErrorKind.INVALID_REQUEST, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.param = param

    @property
    def code(self) -> str:
        return self.kind.value


@dataclass(frozen=True)
class SamplingParams:
    """What the core needs to sample and stop; validated already (the wire's pydantic model does it)."""

    max_tokens: int | None = None
    """None: up to the context length."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1


@dataclass
class EngineRequest:
    """A tokenised request, ready for :meth:`LLMEngine.add_request`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_namespace: str | None = None
    """Requests with different namespaces never share prefix-cache blocks."""
    deadline: float | None = None
    """Unix time after which the engine aborts the request."""
    grammar: Grammar | None = None
    """Structured output: every choice's tokens are held to this grammar."""
    tool_parser: Callable[[], ToolCallParser] | None = None
    """Tool calling: makes each choice's parser, which finds the calls in its text."""


@dataclass
class ToolCall:
    """A function call found in a choice's output; ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str


@dataclass
class Logprob:
    """The sampled token's logprob and the most likely alternatives, as token ids."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class ChoiceDelta:
    """What one step added to one choice; ``finish_reason`` is set on the choice's last delta."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[Logprob] | None = None
    tool_calls: list[ToolCall] | None = None
    finish_reason: FinishReason | None = None


@dataclass
class RequestUsage:
    """Usage of a finished request (all choices)."""

    finish_reasons: list[FinishReason]
    """One per choice."""
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def finish_reason(self) -> FinishReason:
        return self.finish_reasons[0]


@dataclass
class RequestOutput:
    """What one step (or an abort) produced for one request; ``usage`` is set once it is finished."""

    request_id: str
    deltas: list[ChoiceDelta] = field(default_factory=list)
    usage: RequestUsage | None = None

    @property
    def finished(self) -> bool:
        return self.usage is not None
