"""The engine core's own types: what a request asks for and what each step produces.

Plain dataclasses, no pydantic: the core knows nothing of the wire. The serving layer
builds :class:`EngineRequest` from the RPC's ``GenerateRequest`` (``engine/serving/requests.py``)
and turns :class:`RequestOutput` into the RPC's frames (``engine/serving/frames.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from engine.errors import ErrorKind, RequestError
from engine.structured.tool_calls import ToolCall

if TYPE_CHECKING:
    from engine.structured.grammar import Grammar
    from engine.structured.reasoning import ReasoningParser
    from engine.structured.tool_calls import ToolCallParser

__all__ = [
    "ChoiceDelta",
    "EngineRequest",
    "ErrorKind",
    "FinishReason",
    "Logprob",
    "RequestError",
    "RequestOutput",
    "RequestUsage",
    "SamplingParams",
    "ToolCall",
]

FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


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
    reasoning_parser: Callable[[], ReasoningParser] | None = None
    """Reasoning models: makes each choice's parser, which tells its thinking from its answer."""


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
    reasoning: str = ""
    """Text of the model's thinking (``reasoning_content``); ``text`` is the answer."""
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
    reasoning_tokens: int = 0
    """Of ``completion_tokens``, those spent thinking."""

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
