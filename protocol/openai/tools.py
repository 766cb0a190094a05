"""The parts of a chat request that structured output and tool calling add: the tool calls an
earlier assistant turn made, and ``response_format`` (docs/structured-output.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import JsonDict
from pydantic_core import PydanticCustomError

from protocol.rpc import NamedToolChoice, ToolChoice, ToolSpec


def drop_sdk_echoes(data: Any, fields: tuple[str, ...]) -> Any:
    """Drop what the ``openai`` SDK adds to a reply it parsed (``parsed``, ``parsed_arguments``,
    empty ``annotations``...), so that appending ``completion.choices[0].message`` to the
    conversation, as the SDK's docs do, just works. Only empty values or the SDK's own fields."""
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if k not in fields or (k not in _SDK_ONLY and v)}
    return data


_SDK_ONLY = ("parsed", "parsed_arguments")


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str

    @model_validator(mode="before")
    @classmethod
    def _sdk_echoes(cls, data: Any) -> Any:
        return drop_sdk_echoes(data, ("parsed_arguments",))


class ToolCallIn(BaseModel):
    """A tool call an earlier assistant turn made, sent back as part of the conversation."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``text``, ``json_object`` or ``json_schema`` (one model, so errors name plain paths)."""

    model_config = ConfigDict(
        extra="forbid",
        # Two alternatives rather than if/then/else: schemathesis's fuzzer judged a request by a
        # validator that skips if/then, and sent `json_schema: null` with type json_schema as valid.
        json_schema_extra={
            "anyOf": [
                {
                    "required": ["type", "json_schema"],
                    "properties": {"type": {"enum": ["json_schema"]}, "json_schema": {"type": "object"}},
                },
                {
                    "properties": {"type": {"enum": ["text", "json_object"]}},
                    "not": {"required": ["json_schema"]},
                },
            ]
        },
    )

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError(
                "tern_invalid",
                "'response_format.json_schema' is required with type 'json_schema' and only allowed with it.",
                {"param": "response_format.json_schema"},
            )
        return self


ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


# The cross-field rules, said in the JSON schema (the OpenAPI document) too.
TOOL_CHOICE_RULE: JsonDict = {
    "if": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": ["none", None]}}}},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
}
TOOL_RESULT_RULE: JsonDict = {
    "if": {"required": ["role"], "properties": {"role": {"const": "tool"}}},
    "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}},
}


def check_tool_choice(choice: ToolChoice | None, tools: list[ToolSpec]) -> ToolChoice | None:
    """A ``tool_choice`` other than ``none`` needs ``tools``, and a named function must be one of them."""
    if choice is None or choice == "none":
        return choice
    if not tools:
        raise PydanticCustomError(
            "tern_invalid",
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
            {"param": "tool_choice"},
        )
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
        raise PydanticCustomError(
            "tern_invalid",
            "Invalid value for 'tool_choice': no function named '{name}' is in 'tools'.",
            {"param": "tool_choice", "name": choice.function.name},
        )
    return choice
