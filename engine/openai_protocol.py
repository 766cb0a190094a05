"""The OpenAI surface shared by the gateway and the engine's own OpenAI server.

Request schemas for ``/v1/chat/completions`` and ``/v1/completions``, their
conversion to an RPC :class:`~engine.protocol.GenerateRequest`, the error body
shape, and the formatters that turn RPC frames into OpenAI SSE chunks or one
response object. Both servers use this module so their surfaces cannot drift.
Like ``engine/protocol.py`` it must stay free of torch.

Parameter policy: unknown fields are a 400 ("Unrecognized request argument
supplied"), as OpenAI answers. Known OpenAI fields that only describe the
caller (``user``, ``store``, ``metadata``, ...) are accepted and ignored. Known
fields that would change the output and that Tern cannot honour (``tools``,
``logit_bias``, ``response_format`` other than text, ``echo``, ...) are a 400
naming the parameter unless they are left at their neutral value, so a client
never silently gets something other than what it asked for.
"""

from __future__ import annotations

import time
from typing import Any, Literal, TypeVar

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engine.protocol import (
    DeltaFrame,
    ErrorFrame,
    FinalFrame,
    GenerateRequest,
    TokenLogprob,
)

# --------------------------------------------------------------------------- errors

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "insufficient_quota",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_body(
    message: str, *, status: int, param: str | None = None, code: str | None = None, type: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape; ``type`` defaults from the status code."""
    err_type = type or _TYPE_BY_STATUS.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class OpenAIRequestError(Exception):
    """A request the OpenAI surface refuses; carries everything :func:`error_body` needs."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, status=self.status, param=self.param, code=self.code)


def describe_validation_errors(errors: list[Any]) -> tuple[str, str | None]:
    """A one-line message and the offending parameter for pydantic's first error."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    param = (first.get("ctx") or {}).get("param") or ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "We could not parse the JSON body of your request. It must be valid JSON.", None
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param
    if kind in ("model_type", "model_attributes_type") and not loc:
        return "The request body must be a JSON object.", None
    msg = str(first.get("msg", "Invalid request."))
    msg = msg.removeprefix("Value error, ")
    if kind.startswith("tern_"):
        return msg, param
    return (f"Invalid value for '{param}': {msg}" if param else msg), param


# --------------------------------------------------------------------------- requests

# Accepted and ignored: they describe the caller, not the output.
_IGNORED_FIELDS = ("user", "store", "metadata", "service_tier", "parallel_tool_calls", "safety_identifier")


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


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # vLLM-style extras
    top_k: int | None = Field(default=None, ge=-1, description="-1 or 0 disables top-k")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
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


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    """One chat message as OpenAI accepts it; text content only."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    refusal: str | None = None

    def to_rpc(self) -> dict[str, Any]:
        """The RPC's :class:`ChatMessage`, as a dict (see ``_generate_request``)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content}
        message |= {
            k: v for k, v in (("name", self.name), ("tool_call_id", self.tool_call_id)) if v is not None
        }
        if self.tool_calls is not None:
            message["tool_calls"] = self.tool_calls
        return message


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return _refuse_unsupported(
            data,
            {
                "logit_bias": ({},),
                "tools": ([],),
                "tool_choice": ("none",),
                "functions": ([],),
                "function_call": ("none",),
                "response_format": ({"type": "text"},),
                "modalities": (["text"],),
                "audio": (),
                "prediction": (),
                "reasoning_effort": (),
                "web_search_options": (),
            },
        )

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

    def to_generate_request(
        self, *, request_id: str, cache_namespace: str | None = None, deadline: float | None = None
    ) -> GenerateRequest:
        max_tokens = self.max_completion_tokens or self.max_tokens
        sampling = self._sampling(
            max_tokens=max_tokens, logprobs=self.logprobs, top_logprobs=self.top_logprobs or 0
        )
        return _generate_request(
            {
                "request_id": request_id,
                "model": self.model,
                "messages": [m.to_rpc() for m in self.messages],
                "sampling": sampling,
                "cache_namespace": cache_namespace,
                "deadline": deadline,
            }
        )


class CompletionRequest(_Request):
    """``POST /v1/completions`` (one prompt per request: text or token ids)."""

    prompt: str | list[int] | list[str] | list[list[int]]
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
            max_tokens=self.max_tokens, logprobs=logprobs, top_logprobs=self.logprobs or 0
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
RequestT = TypeVar("RequestT", ChatCompletionRequest, CompletionRequest)


def parse_request(request_cls: type[RequestT], raw: bytes | str) -> RequestT:
    """Validate a raw JSON body; every failure becomes a 400 :class:`OpenAIRequestError`."""
    try:
        return request_cls.model_validate_json(raw)
    except ValidationError as exc:
        message, param = describe_validation_errors(exc.errors())
        raise OpenAIRequestError(400, message, param=param) from None


# --------------------------------------------------------------------------- responses

Frame = DeltaFrame | FinalFrame | ErrorFrame
SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def error_frame_body(frame: ErrorFrame) -> dict[str, Any]:
    return error_body(frame.message, status=frame.status, code=frame.code)


def _chat_logprob(lp: TokenLogprob) -> dict[str, Any]:
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": lp.bytes,
        "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in lp.top_logprobs],
    }


class _Formatter:
    """Per-request identity (id, model, created) and per-choice bookkeeping."""

    def __init__(self, request: OpenAIRequest, *, request_id: str, created: int | None = None) -> None:
        self.is_chat = isinstance(request, ChatCompletionRequest)
        self.id = f"chatcmpl-{request_id}" if self.is_chat else f"cmpl-{request_id}"
        self.object = "chat.completion" if self.is_chat else "text_completion"
        self.model = request.model
        self.n = request.n
        self.created = int(time.time()) if created is None else created
        self.finish_reasons: dict[int, str] = {}
        self._text_offset: dict[int, int] = {}

    def _completion_logprobs(self, index: int, lps: list[TokenLogprob]) -> dict[str, Any]:
        """Legacy completions logprobs; ``text_offset`` counts characters from the completion start."""
        offset = self._text_offset.get(index, 0)
        offsets = []
        for lp in lps:
            offsets.append(offset)
            offset += len(lp.token)
        self._text_offset[index] = offset
        return {
            "tokens": [lp.token for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{t.token: t.logprob for t in lp.top_logprobs} for lp in lps],
            "text_offset": offsets,
        }

    def _final_reason(self, index: int, final: FinalFrame) -> str:
        if index < len(final.finish_reasons):
            return final.finish_reasons[index]
        return final.finish_reason


class StreamFormatter(_Formatter):
    """RPC frames in, SSE bytes out (``chat.completion.chunk`` / ``text_completion``)."""

    def __init__(self, request: OpenAIRequest, *, request_id: str, created: int | None = None) -> None:
        super().__init__(request, request_id=request_id, created=created)
        self.include_usage = request.include_usage
        self.object = "chat.completion.chunk" if self.is_chat else "text_completion"

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse_event(
            {
                "id": self.id,
                "object": self.object,
                "created": self.created,
                "model": self.model,
                "choices": choices,
            }
            | extra
        )

    def _finish_choice(self, index: int, reason: str) -> dict[str, Any]:
        self.finish_reasons[index] = reason
        if self.is_chat:
            return {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}
        return {"index": index, "text": "", "logprobs": None, "finish_reason": reason}

    def start(self) -> bytes:
        """The opening chunk: chat sends the assistant role for every choice; completions send nothing."""
        if not self.is_chat:
            return b""
        return self._chunk(
            [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(self.n)
            ]
        )

    def frame(self, frame: Frame) -> bytes:
        """SSE bytes for one frame; a final or error frame also ends the stream with ``[DONE]``."""
        if isinstance(frame, DeltaFrame):
            return self._delta(frame)
        if isinstance(frame, FinalFrame):
            return self._final(frame)
        return sse_event(error_frame_body(frame)) + SSE_DONE

    def _delta(self, frame: DeltaFrame) -> bytes:
        out = b""
        if frame.text or frame.logprobs:
            if self.is_chat:
                logprobs = (
                    {"content": [_chat_logprob(lp) for lp in frame.logprobs]} if frame.logprobs else None
                )
                choice = {"index": frame.index, "delta": {"content": frame.text}, "logprobs": logprobs}
            else:
                logprobs = self._completion_logprobs(frame.index, frame.logprobs) if frame.logprobs else None
                choice = {"index": frame.index, "text": frame.text, "logprobs": logprobs}
            if frame.finish_reason is not None and not self.is_chat:
                self.finish_reasons[frame.index] = frame.finish_reason
                return self._chunk([choice | {"finish_reason": frame.finish_reason}])
            out += self._chunk([choice | {"finish_reason": None}])
        if frame.finish_reason is not None:
            out += self._chunk([self._finish_choice(frame.index, frame.finish_reason)])
        return out

    def _final(self, final: FinalFrame) -> bytes:
        out = b"".join(
            self._chunk([self._finish_choice(i, self._final_reason(i, final))])
            for i in range(self.n)
            if i not in self.finish_reasons
        )
        if self.include_usage:
            usage = usage_dict(final.prompt_tokens, final.completion_tokens, final.cached_tokens)
            out += self._chunk([], usage=usage)
        return out + SSE_DONE


class ResponseAccumulator(_Formatter):
    """RPC frames in, one ``chat.completion`` / ``text_completion`` object out."""

    def __init__(self, request: OpenAIRequest, *, request_id: str, created: int | None = None) -> None:
        super().__init__(request, request_id=request_id, created=created)
        self._text: dict[int, list[str]] = {i: [] for i in range(self.n)}
        self._logprobs: dict[int, list[TokenLogprob]] = {}

    def add(self, frame: DeltaFrame) -> None:
        self._text.setdefault(frame.index, []).append(frame.text)
        if frame.logprobs:
            self._logprobs.setdefault(frame.index, []).extend(frame.logprobs)
        if frame.finish_reason is not None:
            self.finish_reasons[frame.index] = frame.finish_reason

    def response(self, final: FinalFrame) -> dict[str, Any]:
        choices = []
        for index in sorted(self._text):
            text = "".join(self._text[index])
            reason = self.finish_reasons.get(index) or self._final_reason(index, final)
            lps = self._logprobs.get(index)
            if self.is_chat:
                logprobs = {"content": [_chat_logprob(lp) for lp in lps]} if lps else None
                choice = {"index": index, "message": {"role": "assistant", "content": text}}
            else:
                logprobs = self._completion_logprobs(index, lps) if lps else None
                choice = {"index": index, "text": text}
            choices.append(choice | {"logprobs": logprobs, "finish_reason": reason})
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_dict(final.prompt_tokens, final.completion_tokens, final.cached_tokens),
        }
