"""Chat messages as ``/v1/chat/completions`` accepts them (text content only), and their RPC form."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator
from pydantic_core import PydanticCustomError

from protocol.openai.tools import TOOL_RESULT_RULE, ToolCallIn, drop_sdk_echoes


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    """One chat message as OpenAI accepts it; text content only."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"allOf": [TOOL_RESULT_RULE]})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    """An earlier answer's thinking, sent back (templates such as Qwen3's decide what to keep of it)."""

    @model_validator(mode="before")
    @classmethod
    def _sdk_echoes(cls, data: Any) -> Any:
        return drop_sdk_echoes(data, ("parsed", "annotations", "audio", "function_call"))

    @model_validator(mode="after")
    def _tool_result_names_its_call(self) -> ChatMessageIn:
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError(
                "tern_invalid",
                "Messages with role 'tool' must have a 'tool_call_id' naming the call they answer.",
                {"param": "messages"},
            )
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """Name what is unsupported (an image, audio, a file) instead of pydantic's union path."""
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise PydanticCustomError(
                        "tern_unsupported",
                        "Content parts of type '{kind}' are not supported: this model takes text input only.",
                        {"kind": kind},
                    )
        return content

    def to_rpc(self) -> dict[str, Any]:
        """The RPC's :class:`ChatMessage`, as a dict (see ``_generate_request``)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content}
        message |= {
            k: v
            for k, v in (
                ("name", self.name),
                ("tool_call_id", self.tool_call_id),
                ("reasoning_content", self.reasoning_content),
            )
            if v is not None
        }
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return message
