"""Reasoning models through the gateway, with the official ``openai`` client: the default SmolLM2 GGUF
served with Qwen3's chat template as shipped (``--chat-template-file``), and with Llama 3.1's.

SmolLM2 never opens a think block of its own accord; with a constrained answer (``response_format``,
a forced tool call) the grammar writes the think block that Qwen3's template leaves room for, then
holds the answer to the schema, so these tests see real thinking on the wire. What a small model
cannot be made to write (Qwen3 thinking unconstrained, calls in ``auto``) is covered by recorded
token streams in tests/engine/test_reasoning.py; here the wire format and the billing are checked.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from credentials import TEST_ADMIN_KEY, TEST_SECRET
from live_server import ServerThread, create_inference_key
from pydantic import BaseModel
from real_engine import RealEngine
from test_usage_e2e import wait_for_rows

from gateway.app import create_app
from gateway.config import Settings

pytestmark = pytest.mark.slow

TEMPLATES = Path(__file__).parent.parent / "data" / "chat_templates"
QWEN3 = "smollm2-qwen3-template"
LLAMA3 = "smollm2-llama3-template"
THINK = {"enable_thinking": True}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


class City(BaseModel):
    city: str
    country: str
    population: int


WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def template_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RealEngine]]:
    log_dir = tmp_path_factory.mktemp("reasoning-engines")
    engines = [
        RealEngine(
            log_dir,
            extra_args=(
                *("--served-model-name", QWEN3),
                *("--chat-template-file", str(TEMPLATES / "qwen3.jinja")),
                *("--thinking-budget-chars", "160"),
            ),
        ),
        RealEngine(
            log_dir,
            extra_args=(
                *("--served-model-name", LLAMA3),
                *("--chat-template-file", str(TEMPLATES / "llama3.1.jinja")),
            ),
        ),
    ]
    for engine in engines:
        engine.launch()
    try:
        for engine in engines:
            engine.wait_ready()
        yield engines
    finally:
        for engine in engines:
            engine.stop()


@pytest.fixture
def client(template_engines: list[RealEngine], database_url: str, redis_url: str) -> Iterator[openai.OpenAI]:
    settings = Settings(
        database_url=database_url,
        redis_url=redis_url,
        secret=TEST_SECRET,
        admin_key=TEST_ADMIN_KEY,
        engine_urls=[engine.url for engine in template_engines],
        log_level="WARNING",
    )
    server = ServerThread(create_app(settings)).start()
    try:
        key = create_inference_key(server.url, TEST_ADMIN_KEY)
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    finally:
        server.stop()


def reasoning_of(message: Any) -> str | None:
    """``reasoning_content`` is not in the SDK's types: it arrives as an extra field."""
    extra = message.model_extra or {}
    return extra.get("reasoning_content")


def test_reasoning_and_content_apart_streamed_and_not_and_billed(
    client: openai.OpenAI, database_url: str
) -> None:
    ask: dict[str, Any] = {
        "model": QWEN3,
        "messages": [{"role": "user", "content": "Describe Paris."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": City.model_json_schema()},
        },
        "temperature": 0,
        "max_tokens": 200,
        "extra_body": {"chat_template_kwargs": THINK},
    }
    reply = client.chat.completions.create(**ask)
    message = reply.choices[0].message
    thought = reasoning_of(message)
    assert thought and "<think>" not in thought and "</think>" not in thought
    assert City.model_validate_json(message.content or ""), message.content  # the answer alone
    usage = reply.usage
    assert usage is not None and usage.completion_tokens_details is not None
    reasoning_tokens = usage.completion_tokens_details.reasoning_tokens or 0
    assert 0 < reasoning_tokens < usage.completion_tokens

    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_thought = "".join(reasoning_of(d) or "" for d in deltas)
    streamed_content = "".join(d.content or "" for d in deltas)
    assert (streamed_thought, streamed_content) == (thought, message.content), "greedy: the same answer"
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not reasoning_of(d) for d in deltas[first_content:]), "thinking comes first"
    streamed_usage = chunks[-1].usage
    assert streamed_usage is not None and streamed_usage.completion_tokens_details is not None
    assert streamed_usage.completion_tokens_details.reasoning_tokens == reasoning_tokens

    rows = wait_for_rows(database_url, 2)
    assert sorted(r["reasoning_tokens"] for r in rows) == [reasoning_tokens, reasoning_tokens]
    assert sum(r["completion_tokens"] for r in rows) == 2 * usage.completion_tokens  # billed as completion


def test_enable_thinking_false_gives_no_think_block(client: openai.OpenAI, database_url: str) -> None:
    reply = client.chat.completions.parse(
        model=QWEN3,
        messages=[{"role": "user", "content": "Describe Paris."}],
        response_format=City,
        temperature=0,
        max_tokens=120,
        extra_body=NO_THINK,
    )
    message = reply.choices[0].message
    assert isinstance(message.parsed, City) and reasoning_of(message) is None
    plain = client.chat.completions.create(
        model=QWEN3,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=30,
        reasoning_effort="none",
    )
    assert "<think>" not in (plain.choices[0].message.content or "")
    assert reasoning_of(plain.choices[0].message) is None
    for answer in (reply, plain):
        assert answer.usage is not None and answer.usage.completion_tokens_details is not None
        assert answer.usage.completion_tokens_details.reasoning_tokens == 0
    rows = wait_for_rows(database_url, 2)
    assert [r["reasoning_tokens"] for r in rows] == [0, 0]


def test_parse_with_thinking_on_returns_the_parsed_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.parse(
        model=QWEN3,
        messages=[{"role": "user", "content": "Describe Paris."}],
        response_format=City,
        temperature=0,
        max_tokens=200,
        extra_body={"chat_template_kwargs": THINK},
    )
    message = reply.choices[0].message
    assert isinstance(message.parsed, City), message.content
    assert reasoning_of(message)


def round_trip(client: openai.OpenAI, model: str) -> tuple[Any, Any]:
    """A forced call, its result sent back, the model's answer."""
    messages: list[Any] = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    first = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=120
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"]
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 18})})
    answer = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], temperature=0, max_tokens=40
    )
    return first, answer


def test_tool_round_trip_in_hermes_format(client: openai.OpenAI) -> None:
    first, answer = round_trip(client, QWEN3)
    assert reasoning_of(first.choices[0].message)  # thought first, then the <tool_call> block
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls

    chunks = list(
        client.chat.completions.create(
            model=QWEN3,
            messages=[{"role": "user", "content": "Weather in Rome?"}],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0,
            max_tokens=120,
            stream=True,
        )
    )
    pieces = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert pieces[0].id and pieces[0].function and pieces[0].function.name == "get_weather"
    arguments = "".join(p.function.arguments or "" for p in pieces if p.function)
    assert json.loads(arguments)["city"]  # the argument deltas add up to the call's JSON
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_round_trip_in_llama3_json_format(client: openai.OpenAI) -> None:
    first, answer = round_trip(client, LLAMA3)
    assert reasoning_of(first.choices[0].message) is None  # Llama 3.1's template has no thinking
    assert first.choices[0].message.content is None
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_responses_create_with_a_reasoning_item(client: openai.OpenAI, database_url: str) -> None:
    ask: dict[str, Any] = {
        "model": QWEN3,
        "input": "Describe Paris.",
        "text": {"format": {"type": "json_schema", "name": "city", "schema": City.model_json_schema()}},
        "max_output_tokens": 200,
        "temperature": 0,
        "reasoning": {"effort": "medium"},
    }
    reply = client.responses.create(**ask)
    kinds = [item.type for item in reply.output]
    assert kinds == ["reasoning", "message"]
    reasoning = reply.output[0]
    assert reasoning.type == "reasoning" and reasoning.content and reasoning.content[0].text
    assert City.model_validate_json(reply.output_text)
    assert reply.usage is not None and reply.usage.output_tokens_details.reasoning_tokens > 0

    events = list(client.responses.create(**ask, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == reasoning.content[0].text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.usage is not None
    assert (
        final.usage.output_tokens_details.reasoning_tokens
        == reply.usage.output_tokens_details.reasoning_tokens
    )

    rows = wait_for_rows(database_url, 2)
    assert [r["reasoning_tokens"] for r in rows] == [reply.usage.output_tokens_details.reasoning_tokens] * 2
