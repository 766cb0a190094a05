"""End to end: structured output and tools (issue 15) through a real ``tern up``, with the official
client's ``parse``, ``stream`` and tool calls, on the real default model; billed like any request.

The stack comes from tests/e2e/conftest.py (this module gets its own ``tern up``).
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from running_stack import PROMPT, RunningStack, client_for, new_tenant_and_key, wait_for_usage_rows

pytestmark = pytest.mark.slow


class Address(BaseModel):
    city: str = Field(max_length=40)
    country: str = Field(max_length=40)


class Person(BaseModel):  # nested objects
    name: str = Field(max_length=40)
    home: Address


class Item(BaseModel):
    name: str = Field(max_length=30)
    quantity: int = Field(ge=1, le=20)


class ShoppingList(BaseModel):  # arrays
    items: list[Item] = Field(min_length=1, max_length=5)


class Sentiment(StrEnum):
    positive = "positive"
    negative = "negative"
    neutral = "neutral"


class Review(BaseModel):  # enums
    sentiment: Sentiment


class Rating(BaseModel):  # numbers with bounds
    stars: int = Field(ge=1, le=5)
    confidence: float = Field(ge=0, le=1)


class Contact(BaseModel):  # optional fields
    name: str = Field(max_length=40)
    email: str | None = Field(default=None, max_length=60)
    phone: str | None = Field(default=None, max_length=20)


STRUCTURED_CASES: list[tuple[type[BaseModel], str]] = [
    (Person, "Where does Ada Lovelace live? Answer with her name and home city and country."),
    (ShoppingList, "Make a shopping list for pancakes."),
    (Review, "Classify the sentiment of this review: 'I loved this movie, it was wonderful!'"),
    (Rating, "Rate the restaurant review 'Great food, slow service' from 1 to 5 stars."),
    (Contact, "Extract the contact: 'Call John Smith at 555-0100.'"),
]
STRUCTURED_IDS = [case[0].__name__ for case in STRUCTURED_CASES]


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]


class GetTime(BaseModel):
    """Current local time in a city."""

    city: str = Field(max_length=40)


# Usage the engine reported for the structured requests (their own tenant, billed like any other).
structured_usage: list[openai.types.CompletionUsage] = []


@pytest.fixture(scope="module")
def structured_key(admin: httpx.Client) -> dict[str, Any]:
    return new_tenant_and_key(admin, "e2e-structured")


@pytest.fixture(scope="module")
def structured_client(stack: RunningStack, structured_key: dict[str, Any]) -> openai.OpenAI:
    return client_for(stack, structured_key)


@pytest.mark.parametrize(("schema", "prompt"), STRUCTURED_CASES, ids=STRUCTURED_IDS)
def test_parse_returns_a_parsed_object(
    structured_client: openai.OpenAI, model: str, schema: type[BaseModel], prompt: str
) -> None:
    messages: list[Any] = [{"role": "user", "content": prompt}]
    reply = structured_client.chat.completions.parse(
        model=model, messages=messages, response_format=schema, max_tokens=150, temperature=0
    )
    assert isinstance(reply.choices[0].message.parsed, schema), reply.choices[0].message.content
    assert reply.usage is not None
    structured_usage.append(reply.usage)


@pytest.mark.parametrize(("schema", "prompt"), STRUCTURED_CASES, ids=STRUCTURED_IDS)
def test_streamed_parse_returns_a_parsed_object(
    structured_client: openai.OpenAI, model: str, schema: type[BaseModel], prompt: str
) -> None:
    messages: list[Any] = [{"role": "user", "content": prompt}]
    with structured_client.chat.completions.stream(
        model=model,
        messages=messages,
        response_format=schema,
        max_tokens=150,
        temperature=0,
        stream_options={"include_usage": True},
    ) as stream:
        pieces = [e for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(pieces) > 1, "structured output streams too"
    assert isinstance(final.choices[0].message.parsed, schema)
    assert final.usage is not None
    structured_usage.append(final.usage)


def test_json_object_output_parses(structured_client: openai.OpenAI, model: str) -> None:
    prompt = "Return a JSON object with the keys city and country for the capital of France."
    reply = structured_client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        response_format={"type": "json_object"},
        max_tokens=100,
        temperature=0,
    )
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    assert reply.usage is not None
    structured_usage.append(reply.usage)


def test_a_required_tool_call_validates_and_its_result_gets_a_text_answer(
    structured_client: openai.OpenAI, model: str
) -> None:
    tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]
    messages: list[Any] = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    reply = structured_client.chat.completions.parse(
        model=model, messages=messages, tools=tools, tool_choice="required", max_tokens=100, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.id and isinstance(call.function.parsed_arguments, GetWeather | GetTime)  # validated
    assert reply.usage is not None
    structured_usage.append(reply.usage)

    result = {"temperature_celsius": 18, "sky": "sunny"}
    messages += [  # the reply itself goes back, as the SDK's docs show
        choice.message,
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
    ]
    answer = structured_client.chat.completions.create(
        model=model, messages=messages, tools=tools, max_tokens=60, temperature=0
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.usage is not None
    structured_usage.append(answer.usage)


def test_a_streamed_tool_call_arrives_in_openai_shape(structured_client: openai.OpenAI, model: str) -> None:
    tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]
    with structured_client.chat.completions.stream(
        model=model,
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "GetTime"}},
        max_tokens=60,
        temperature=0,
        stream_options={"include_usage": True},
    ) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls or []
    assert call.function.name == "GetTime" and isinstance(call.function.parsed_arguments, GetTime)
    assert final.usage is not None
    structured_usage.append(final.usage)


def test_an_unenforceable_schema_is_a_400_naming_the_keyword(
    structured_client: openai.OpenAI, model: str
) -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as refused:
        structured_client.chat.completions.create(
            model=model,
            messages=PROMPT,
            response_format={"type": "json_schema", "json_schema": {"name": "tags", "schema": schema}},
        )
    assert "uniqueItems" in refused.value.message


def test_structured_requests_are_billed_exactly_as_reported(
    admin: httpx.Client, structured_key: dict[str, Any]
) -> None:
    served = 2 * len(STRUCTURED_CASES) + 1 + 2 + 1  # the requests above
    assert len(structured_usage) == served
    rows = wait_for_usage_rows(admin, structured_key["tenant"]["id"], requests=served + 1)
    (row,) = rows
    assert row["requests"] == served + 1 and row["errors"] == 1  # the refused schema: logged, no tokens
    assert row["prompt_tokens"] == sum(u.prompt_tokens for u in structured_usage)
    assert row["completion_tokens"] == sum(u.completion_tokens for u in structured_usage)
