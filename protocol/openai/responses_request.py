"""``POST /v1/responses``: the stateless subset of OpenAI's Responses API, as a chat request.

A Responses request says what a chat request says in other words: ``input`` items are messages
(a ``function_call`` item is an assistant turn's tool call, a ``function_call_output`` item a
``tool`` message), ``instructions`` a system message, ``text.format`` the ``response_format``,
tools are flat (``{"type": "function", "name": ...}``). :meth:`ResponsesRequest.to_chat` makes
that chat request, so limits, routing and the engine see exactly what chat sends them; only the
answer's shape differs (``protocol/openai/responses_events.py``).

Nothing is stored: ``store: true`` and ``previous_response_id`` are a 400 (a conversation goes
back whole in ``input``, as with ``store: false`` on OpenAI). Fields that would change the output
and that Tern cannot honour (built-in tools, images...) are a 400 naming them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from protocol.openai.errors import OpenAIRequestError, describe_validation_errors
from protocol.openai.requests import ChatCompletionRequest, _refuse_unsupported
from protocol.openai.tools import TOOL_CHOICE_RULE

_ECHOES = ("id", "status", "annotations", "logprobs", "parsed", "parsed_arguments")
"""What the ``openai`` SDK's output items carry that an input item does not need (sent back as is)."""


def _unsupported_kind(what: str, kind: str) -> PydanticCustomError:
    return PydanticCustomError(
        "tern_unsupported",
        "{what} of type '{kind}' are not supported by this server.",
        {"what": what, "kind": kind},
    )


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["input_text", "output_text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if data.get("type") not in ("input_text", "output_text", None):
                raise _unsupported_kind("Content parts", str(data.get("type")))
            data = {k: v for k, v in data.items() if k not in _ECHOES}
        return data


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    """A call the model made earlier (the SDK's own output item, sent back)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    """A function's result, for the call with ``call_id``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")]
_ITEM_TYPES = ("message", "function_call", "function_call_output")


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "function":
            raise _unsupported_kind("Tools", str(data.get("type")))
        return data


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")  # a tool's name


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its fields alongside."""

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        json_schema_extra={  # alternatives, not if/then: see ResponseFormat in protocol/openai/tools.py
            "anyOf": [
                {
                    "required": ["type", "name"],
                    "properties": {"type": {"enum": ["json_schema"]}, "name": {"type": "string"}},
                },
                {"properties": {"type": {"enum": ["text", "json_object"]}}},
            ]
        },
    )

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_named(self) -> TextFormat:
        if self.type == "json_schema" and self.name is None:
            raise PydanticCustomError(
                "tern_invalid",
                "'text.format.name' is required with type 'json_schema'.",
                {"param": "text.format"},
            )
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))
    verbosity: Literal["medium"] | None = None


class ReasoningConfig(BaseModel):
    """``reasoning``: ``effort`` ``none``/``minimal`` turns a reasoning model's thinking off (as the
    chat API's ``reasoning_effort``); the thinking itself comes back as a ``reasoning`` item."""

    model_config = ConfigDict(extra="forbid")

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        default=None, description="Accepted; the item carries the whole reasoning text, not a summary"
    )
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "store": (False,),
    "previous_response_id": (),
    "conversation": (),
    "include": ([],),
    "background": (False,),
    "truncation": ("disabled",),
    "max_tool_calls": (),
    "top_logprobs": (0,),
    "prompt": (),
}


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` (stateless: nothing is stored, nothing is looked up)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"allOf": [TOOL_CHOICE_RULE]})

    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: Literal[False] | None = Field(default=None, description="Nothing is stored: true is a 400")
    previous_response_id: None = Field(default=None, description="Nothing is stored to refer to: a 400")

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if data.get("store") is True or data.get("previous_response_id") is not None:
                param = "store" if data.get("store") is True else "previous_response_id"
                raise PydanticCustomError(
                    "tern_unsupported",
                    "Stored responses are not supported by this server: send 'store': false and the whole "
                    "conversation in 'input' (previous_response_id cannot refer to anything).",
                    {"param": param},
                )
            data = {k: v for k, v in data.items() if k not in ("stream_options", "prompt_cache_key")}
            if isinstance(data.get("input"), list):
                # An earlier answer's reasoning items, sent back: the model does not see its past thinking.
                kept = [i for i in data["input"] if not _is_reasoning(i)]
                data["input"] = [_input_item(item) for item in kept]
        return _refuse_unsupported(data, _NEUTRAL)

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: consecutive calls become one assistant turn."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = out[-1] if out else None
                if last and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return out

    def response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request that asks the engine for the same answer (a 400 if it is not one)."""
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages() or [{"role": "user", "content": ""}],
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "response_format": self.response_format(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "reasoning_effort": self.reasoning.effort if self.reasoning else None,
        }
        if self.stream:
            fields["stream_options"] = {"include_usage": True}
        if self.tools:
            fields["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunction):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            message, param = describe_validation_errors(exc.errors())
            raise OpenAIRequestError(400, message, param=_responses_param(param)) from None


def _is_reasoning(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") == "reasoning"


def _input_item(item: Any) -> Any:
    """An item as its model takes it: ``type`` defaults to ``message``, the SDK's echoes dropped."""
    if not isinstance(item, dict):
        return item
    item = {"type": "message"} | item
    kind = item.get("type")
    if kind not in _ITEM_TYPES:
        raise _unsupported_kind("Input items", str(kind))
    for part in item.get("content") if isinstance(item.get("content"), list) else []:
        if isinstance(part, dict) and part.get("type") not in ("input_text", "output_text"):
            raise _unsupported_kind("Content parts", str(part.get("type")))
    return {k: v for k, v in item.items() if k not in _ECHOES}


def _responses_param(param: str | None) -> str | None:
    """A chat field's name as the Responses request calls it."""
    names = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
    if param is None:
        return None
    head, _, rest = param.partition(".")
    return names.get(head, head) + (f".{rest}" if rest else "")


def parse_responses_request(raw: bytes | str) -> ResponsesRequest:
    """Validate a raw JSON body; every failure becomes a 400 :class:`OpenAIRequestError`."""
    try:
        return ResponsesRequest.model_validate_json(raw)
    except ValidationError as exc:
        message, param = describe_validation_errors(exc.errors())
        raise OpenAIRequestError(400, message, param=param) from None
