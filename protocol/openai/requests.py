"""Request schemas for ``/v1/chat/completions`` and ``/v1/completions`` and their conversion to
an RPC :class:`~protocol.rpc.GenerateRequest`.

Parameter policy: unknown fields are a 400 ("Unrecognized request argument
supplied"), as OpenAI answers. Known OpenAI fields that only describe the
caller (``store``, ``metadata``, ...) are accepted and ignored; ``user`` is kept (the gateway
records it on the usage row, at most 256 characters). Known
fields that would change the output and that Tern cannot honour (``logit_bias``,
``echo``, the deprecated ``functions``, ...) are a 400 naming the parameter unless
they are left at their neutral value, so a client never silently gets something
other than what it asked for. ``response_format`` and ``tools`` are honoured by
constrained decoding in the engine (docs/structured-output.md).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonDict
from pydantic_core import PydanticCustomError

from protocol.openai.errors import OpenAIRequestError, describe_validation_errors
from protocol.openai.messages import ChatMessageIn
from protocol.openai.tools import (
    ANY_JSON_OBJECT,
    TOOL_CHOICE_RULE,
    ResponseFormat,
    check_tool_choice,
)
from protocol.rpc import GenerateRequest, ToolChoice, ToolSpec

# Accepted and ignored: they describe the caller, not the output.
_IGNORED_FIELDS = ("store", "metadata", "service_tier", "safety_identifier")
END_USER_MAX_LENGTH = 256


def _refuse_unsupported(data: Any, neutral: dict[str, tuple[Any, ...]]) -> Any:
    """Drop ignored fields; refuse known-but-unsupported fields unless they hold a neutral value."""
    if not isinstance(data, dict):
        return data
    data = {k: v for k, v in data.items() if k not in _IGNORED_FIELDS}
    for name, neutral_values in neutral.items():
        if name not in data:
            continue
        value = data.pop(name)
        if value is not None and value not in neutral_values:
            raise PydanticCustomError(
                "tern_unsupported",
                "The '{param}' parameter is not supported by this server.",
                {"param": name},
            )
    return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


StopText = Annotated[str, Field(min_length=1)]

# The cross-field rules the validators below enforce, said in the JSON schema (the OpenAPI document).
_STREAM_OPTIONS_RULE: JsonDict = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}
_TOP_LOGPROBS_RULE: JsonDict = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"allOf": [_STREAM_OPTIONS_RULE]})

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopText | list[StopText] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # vLLM-style extras
    top_k: int | None = Field(default=None, ge=-1, description="-1 or 0 disables top-k")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    user: str | None = Field(
        default=None,
        max_length=END_USER_MAX_LENGTH,
        description="Your end user's id: recorded on the usage row, for reports by end user",
    )
    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="vLLM's cache salt: prompts with different salts never share cached prefixes. Through "
        "the gateway it narrows the tenant's own cache further; it never widens it.",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _non_empty_stops(cls, stop: Any) -> Any:
        """Before the type's own check, for a message that says what is wrong."""
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stop

    # Field validators, unlike model validators, run only when the field is given: these checks
    # cost nothing on the (usual) requests without it. They read fields declared before theirs.
    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, options: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise PydanticCustomError(
                "tern_invalid",
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                {"param": "stream_options"},
            )
        return options

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def max_tokens_field(self) -> str:
        """The field that bounds the output's length, as the client sent it."""
        return "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        """The most output tokens the client asked for (None: up to the context); the one rule the
        engine request, the limits' admission and the proxy's cap all follow."""
        value: int | None = getattr(self, self.max_tokens_field)
        return value

    def _sampling(self, *, max_tokens: int | None, logprobs: bool, top_logprobs: int) -> dict[str, Any]:
        """The RPC's :class:`SamplingParams`, as the dict ``to_generate_request`` validates."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }
        return {
            "max_tokens": max_tokens,
            "top_k": max(self.top_k or 0, 0),
            "seed": self.seed,
            "stop": stops,
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "top_logprobs": top_logprobs,
            "n": self.n,
            **{k: v for k, v in given.items() if v is not None},
        }


def _generate_request(fields: dict[str, Any]) -> GenerateRequest:
    """One validation of the whole RPC request, nested parts included: on every gateway request,
    cheaper than building each part as a model (and ``model_construct`` is slower still)."""
    return GenerateRequest.model_validate(fields)


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"allOf": [_STREAM_OPTIONS_RULE, _TOP_LOGPROBS_RULE, TOOL_CHOICE_RULE]},
    )

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[ToolSpec] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = Field(
        default=None, description="A named function must be one of `tools` (else a 400, as on OpenAI)"
    )
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        default=None,
        description="Reasoning models: `none` or `minimal` turns thinking off where the chat template "
        "can (Qwen3, SmolLM3); the other values reach the template as its `reasoning_effort`",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="Extra variables for the model's chat template, as vLLM and SGLang take them "
        '(`{"enable_thinking": false}`)',
    )

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return _refuse_unsupported(
            data,
            {
                "logit_bias": ({},),
                "functions": ([],),
                "function_call": ("none",),
                "modalities": (["text"],),
                "audio": (),
                "prediction": (),
                "web_search_options": (),
            },
        )

    @property
    def max_tokens_field(self) -> str:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens`` where both are sent."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs and not info.data.get("logprobs"):
            raise PydanticCustomError(
                "tern_invalid",
                "The 'top_logprobs' parameter requires 'logprobs' to be true.",
                {"param": "top_logprobs"},
            )
        return top_logprobs

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        return check_tool_choice(choice, info.data.get("tools") or [])

    def json_schema(self) -> dict[str, Any] | None:
        """The schema ``response_format`` constrains the output to (None: free text)."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.json_schema is not None and fmt.json_schema.schema_ is not None:
            return fmt.json_schema.schema_
        return ANY_JSON_OBJECT

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables: ``chat_template_kwargs``, and ``reasoning_effort``'s
        switch where the client set no ``enable_thinking`` of its own."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        kwargs = {"reasoning_effort": self.reasoning_effort} | (self.chat_template_kwargs or {})
        if self.reasoning_effort in ("none", "minimal"):
            kwargs.setdefault("enable_thinking", False)
        return kwargs

    def to_generate_request(
        self, *, request_id: str, cache_namespace: str | None = None, deadline: float | None = None
    ) -> GenerateRequest:
        sampling = self._sampling(
            max_tokens=self.requested_max_tokens, logprobs=self.logprobs, top_logprobs=self.top_logprobs or 0
        )
        fields: dict[str, Any] = {
            "request_id": request_id,
            "model": self.model,
            "messages": [m.to_rpc() for m in self.messages],
            "sampling": sampling,
            "cache_namespace": cache_namespace,
            "deadline": deadline,
        }
        # Only when asked for, so the usual request validates no more than before.
        if (schema := self.json_schema()) is not None:
            fields["json_schema"] = schema
        if (template_kwargs := self.template_kwargs()) is not None:
            fields["chat_template_kwargs"] = template_kwargs
        if self.tools:
            fields["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
            if self.tool_choice is not None:
                choice = self.tool_choice
                fields["tool_choice"] = choice if isinstance(choice, str) else choice.model_dump()
            if self.parallel_tool_calls is not None:
                fields["parallel_tool_calls"] = self.parallel_tool_calls
        return _generate_request(fields)


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PROMPT_SCHEMA: dict[str, Any] = {
    "description": "One prompt: text or token ids (a list of one prompt is accepted too)",
    "anyOf": [
        {"type": "string", "minLength": 1},
        _TOKEN_IDS,
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": 1},
    ],
}
"""What ``prompt`` accepts, exactly; pydantic's own schema would not say "not empty" or "one"."""


class CompletionRequest(_Request):
    """``POST /v1/completions`` (one prompt per request: text or token ids)."""

    prompt: Annotated[
        str | list[int] | list[str] | list[list[int]], WithJsonSchema(PROMPT_SCHEMA, mode="validation")
    ]
    logprobs: int | None = Field(default=None, ge=0, le=5)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        data = _refuse_unsupported(data, {"logit_bias": ({},), "echo": (False,), "suffix": ("",)})
        if isinstance(data, dict) and data.get("best_of") is not None:
            if data["best_of"] != data.get("n", 1):
                raise PydanticCustomError(
                    "tern_unsupported",
                    "The '{param}' parameter is not supported by this server (only best_of == n).",
                    {"param": "best_of"},
                )
        if isinstance(data, dict):
            data.pop("best_of", None)
        return data

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise PydanticCustomError(
                    "tern_invalid",
                    "Batched prompts are not supported; send one prompt per request.",
                    {"param": "prompt"},
                )
            prompt = prompt[0]
        if not prompt:
            raise PydanticCustomError("tern_invalid", "The prompt must not be empty.", {"param": "prompt"})
        return prompt

    def to_generate_request(
        self, *, request_id: str, cache_namespace: str | None = None, deadline: float | None = None
    ) -> GenerateRequest:
        logprobs = self.logprobs is not None
        sampling = self._sampling(
            max_tokens=self.requested_max_tokens, logprobs=logprobs, top_logprobs=self.logprobs or 0
        )
        return _generate_request(
            {
                "request_id": request_id,
                "model": self.model,
                "prompt": self.prompt,  # normalised to str | list[int] by the validator
                "sampling": sampling,
                "cache_namespace": cache_namespace,
                "deadline": deadline,
            }
        )


OpenAIRequest = ChatCompletionRequest | CompletionRequest
RequestT = TypeVar("RequestT", bound=BaseModel)


def parse_request(request_cls: type[RequestT], raw: bytes | str) -> RequestT:
    """Validate a raw JSON body; every failure becomes a 400 :class:`OpenAIRequestError`."""
    try:
        return request_cls.model_validate_json(raw)
    except ValidationError as exc:
        message, param = describe_validation_errors(exc.errors())
        raise OpenAIRequestError(400, message, param=param) from None
