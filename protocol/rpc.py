"""The internal RPC between gateway and engine.

Both sides import this module, so it must stay free of torch and of anything
heavy: pydantic only. Paths are versioned; a breaking change gets a new prefix.

Wire format:
- ``POST {RPC_PREFIX}/generate`` takes a :class:`GenerateRequest` as JSON and answers
  NDJSON: zero or more :class:`DeltaFrame` lines, then exactly one
  :class:`FinalFrame` (usage) or one :class:`ErrorFrame`.
  A request that is invalid before any work starts (prompt longer than the
  context, unknown model) is answered with a non-200 status and an OpenAI-shaped
  error body ``{"error": {"message", "type", "param", "code"}}`` instead of a stream.
  A prompt that tokenizes (chat template, tools and all) to more than the request's
  ``max_prompt_tokens`` is refused that way with status :data:`PROMPT_OVER_RESERVATION_STATUS`,
  code :data:`PROMPT_OVER_RESERVATION` and its exact count in ``error.prompt_tokens``: the gateway
  reserves that many tokens against its limits (or refuses the request) and sends it again.
- ``POST {RPC_PREFIX}/abort`` takes :class:`AbortRequest`; unknown ids are not an error.
- ``GET {RPC_PREFIX}/health`` answers :class:`HealthResponse`.
- ``GET {RPC_PREFIX}/models`` answers :class:`ModelList`.
- ``GET {RPC_PREFIX}/ledger?instance=ID`` answers :class:`Ledger`: the engine's short memory of the
  requests whose ``ledger_tag`` names that gateway process, so a restarted gateway bills the
  streams its predecessor lost.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

RPC_PREFIX = "/rpc/v1"
GENERATE_PATH = f"{RPC_PREFIX}/generate"
ABORT_PATH = f"{RPC_PREFIX}/abort"
HEALTH_PATH = f"{RPC_PREFIX}/health"
MODELS_PATH = f"{RPC_PREFIX}/models"
LEDGER_PATH = f"{RPC_PREFIX}/ledger"

PROMPT_OVER_RESERVATION = "prompt_over_reservation"
PROMPT_OVER_RESERVATION_STATUS = 412
"""A prompt longer than its ``max_prompt_tokens``: refused before any work, with the exact count."""

FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ChatMessage(BaseModel):
    """One chat turn; extra keys (tool calls, names) pass through to the template."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class SamplingParams(_Strict):
    max_tokens: int | None = Field(default=None, ge=1, description="None: up to the context length")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 disables top-k")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)
    n: int = Field(default=1, ge=1, le=16)


class FunctionSpec(_Strict):
    """A function the model may call; ``parameters`` is a JSON schema of its arguments object."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Strict):
    type: Literal["function"] = "function"
    function: FunctionSpec


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``tool_choice`` naming one function: the model must call exactly that one."""

    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class GenerateRequest(_Strict):
    request_id: str = Field(min_length=1, max_length=200)
    model: str | None = None
    messages: list[ChatMessage] | None = None
    prompt: str | list[int] | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    cache_namespace: str | None = Field(
        default=None, description="Requests with different namespaces never share prefix-cache blocks"
    )
    deadline: float | None = Field(default=None, description="Unix time after which the engine aborts")
    json_schema: dict[str, Any] | None = Field(
        default=None, description="Constrain the output to JSON valid against this schema (structured output)"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="Extra variables for the chat template (``enable_thinking``: whether a reasoning "
        "model thinks first)",
    )
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    max_prompt_tokens: int | None = Field(
        default=None,
        ge=0,
        description="The prompt tokens the gateway reserved against its limits: a prompt that tokenizes "
        "to more is refused before any work, with its exact count (PROMPT_OVER_RESERVATION)",
    )
    ledger_tag: dict[str, str | float] | None = Field(
        default=None,
        description="Kept with the request's token counts in the engine's ledger (its 'instance' "
        "entry names the gateway process); opaque to the engine",
    )

    @model_validator(mode="after")
    def _exactly_one_input(self) -> GenerateRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("exactly one of 'messages' and 'prompt' must be given")
        return self


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ToolCall(BaseModel):
    """A complete function call the model made; ``arguments`` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str


class DeltaFrame(BaseModel):
    """New text for one choice. ``finish_reason`` is set on the choice's last delta, which also
    carries the choice's tool calls when it made any (``finish_reason`` is then ``tool_calls``)."""

    type: Literal["delta"] = "delta"
    index: int = 0
    text: str = ""
    reasoning: str | None = Field(
        default=None, description="The model's thinking (``reasoning_content``); ``text`` is the answer"
    )
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCall] | None = None
    finish_reason: FinishReason | None = None


class FinalFrame(BaseModel):
    """Usage for the whole request (all choices); always the last frame of a success."""

    type: Literal["final"] = "final"
    finish_reason: FinishReason
    finish_reasons: list[FinishReason] = Field(default_factory=list, description="One per choice")
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int
    reasoning_tokens: int = Field(default=0, description="Of ``completion_tokens``, those spent thinking")


class ErrorFrame(BaseModel):
    """A failure after the stream began. ``completion_tokens`` counts what was produced."""

    type: Literal["error"] = "error"
    message: str
    code: str = "engine_error"
    status: int = 500
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


Frame = Annotated[DeltaFrame | FinalFrame | ErrorFrame, Field(discriminator="type")]
_frame_adapter: TypeAdapter[DeltaFrame | FinalFrame | ErrorFrame] = TypeAdapter(Frame)


def parse_frame(line: bytes | str) -> DeltaFrame | FinalFrame | ErrorFrame:
    """Parse one NDJSON line of a generate stream."""
    return _frame_adapter.validate_json(line)


def encode_frame(frame: DeltaFrame | FinalFrame | ErrorFrame) -> bytes:
    """One NDJSON line, newline included."""
    return frame.model_dump_json(exclude_none=True).encode() + b"\n"


class AbortRequest(_Strict):
    request_id: str


class AbortResponse(BaseModel):
    aborted: bool


class LedgerEntry(BaseModel):
    """What the engine did for one tagged request; counts are final once ``state`` is not running."""

    request_id: str
    tag: dict[str, str | float]
    state: Literal["running", "finished", "aborted"]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ended_at: float | None = None


class Ledger(BaseModel):
    entries: list[LedgerEntry]


class ModelInfo(BaseModel):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "tern"
    created: int = 0
    max_model_len: int | None = None
    prompt_overhead: int | None = None
    """Tokens the chat template adds to a conversation of one empty user message (its default system
    prompt included): what the gateway adds to its prompt estimate, so its reservation usually
    covers the exact count and the engine never has to refuse. A Tern engine that lists it checks
    ``GenerateRequest.max_prompt_tokens`` (None: an engine from before, which does not)."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelInfo]


class HealthResponse(BaseModel):
    status: Literal["ok", "loading", "draining"]
    model: str | None = None
    running: int = 0
    waiting: int = 0
