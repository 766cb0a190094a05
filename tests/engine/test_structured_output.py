"""Structured output and tool calls in the engine: grammars hold every choice, and nothing else.

The tiny random-weight engine samples freely (temperature 1, many seeds), so these tests show the
grammar, not the model, makes the output valid. The real default model's answers are checked end
to end, through the gateway with the official client (tests/e2e/test_structured_output.py).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from bench.engine.structured import bench_mixed_batch
from engine.core.outputs import RequestError
from engine.serving.frames import generate_frames
from engine.serving.requests import engine_request
from engine.structured.grammar import closed_object
from engine.structured.json_closing import closing_text
from engine.structured.tool_calls import ToolCallFormat, ToolCallParser, tool_call_format
from engine.structured.tools import forced_call_grammar, prompt_messages
from protocol.rpc import DeltaFrame, FinalFrame, GenerateRequest, ToolSpec
from tests.engine.tiny_engine import CHATML_TEMPLATE, EngineFactory, make_byte_tokenizer, make_tiny_engine

pytestmark = pytest.mark.usefixtures("one_thread")


SCHEMAS: list[dict[str, Any]] = [
    # nested objects, bounded integer, enum
    closed_object(
        order=closed_object(
            status={"enum": ["open", "paid", "shipped"]},
            count={"type": "integer", "minimum": 1, "maximum": 99},
        )
    ),
    # array with bounds, booleans
    closed_object(flags={"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}),
    # bounded number, optional (nullable) field, short strings
    closed_object(
        score={"type": "number", "minimum": -1, "maximum": 1},
        note={"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
    ),
]


def function_tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


WEATHER = function_tool(
    "get_weather",
    closed_object(unit={"enum": ["c", "f"]}, days={"type": "integer", "minimum": 1, "maximum": 7}),
)
TIME = function_tool("get_time", closed_object(utc={"type": "boolean"}))
TOOLS = [WEATHER, TIME]
NAMES = ["get_weather", "get_time"]
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
# A template with tool support that names the tools only, so prompts fit the tiny model's context.
TOOLS_TEMPLATE = (
    "{% if tools %}{% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}" + CHATML_TEMPLATE
)


@pytest.fixture
def tool_engine(make_engine: EngineFactory) -> Any:
    tokenizer = make_byte_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    return make_tiny_engine(tokenizer)


def wire(request_id: str, **fields: Any) -> GenerateRequest:
    sampling = {"temperature": 1.0, "max_tokens": 120} | fields.pop("sampling", {})
    return GenerateRequest.model_validate(
        {"request_id": request_id, "messages": MESSAGES, "sampling": sampling} | fields
    )


def run(engine: Any, requests: list[GenerateRequest]) -> dict[str, list[DeltaFrame | FinalFrame]]:
    return generate_frames(engine, requests)


def choice_text(frames: list[DeltaFrame | FinalFrame], index: int = 0) -> str:
    return "".join(f.text for f in frames if isinstance(f, DeltaFrame) and f.index == index)


@pytest.mark.parametrize("schema_index", range(len(SCHEMAS)))
def test_sampled_output_always_validates_against_the_schema(
    make_engine: EngineFactory, schema_index: int
) -> None:
    engine = make_engine()
    schema = SCHEMAS[schema_index]
    requests = [wire(f"r{seed}", json_schema=schema, sampling={"seed": seed}) for seed in range(6)]
    for frames in run(engine, requests).values():
        final = frames[-1]
        assert isinstance(final, FinalFrame) and final.finish_reason == "stop"
        jsonschema.validate(json.loads(choice_text(frames)), schema)


def test_every_choice_of_n_is_constrained_on_its_own(make_engine: EngineFactory) -> None:
    engine = make_engine()
    schema = SCHEMAS[0]
    frames = run(engine, [wire("n", json_schema=schema, sampling={"n": 3, "seed": 7})])["n"]
    texts = [choice_text(frames, i) for i in range(3)]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_unconstrained_rows_sample_exactly_as_they_would_alone(make_engine: EngineFactory) -> None:
    """Batch independence: grammar masks touch only the constrained rows."""
    engine = make_engine()
    free = [
        wire("greedy", sampling={"temperature": 0.0, "max_tokens": 24}),
        wire("seeded", sampling={"seed": 3}),
    ]
    alone = run(engine, free)
    constrained = [wire(f"c{i}", json_schema=SCHEMAS[i], sampling={"seed": i}) for i in range(3)]
    mixed = run(engine, [*free, *constrained])
    for request in free:
        rid = request.request_id
        assert choice_text(mixed[rid]) == choice_text(alone[rid])
        assert [t for f in mixed[rid] if isinstance(f, DeltaFrame) for t in f.token_ids] == [
            t for f in alone[rid] if isinstance(f, DeltaFrame) for t in f.token_ids
        ]


@pytest.mark.parametrize("max_tokens", [12, 40])
def test_json_object_mode_gives_an_object_closed_within_max_tokens(
    make_engine: EngineFactory, max_tokens: int
) -> None:
    """The random-weight model rambles at temperature 1: every answer still ends as one object,
    closed in time for its budget (json_closing), with or without speculation's drafts."""
    engine = make_engine()
    requests = [
        wire(f"obj{seed}", json_schema={"type": "object"}, sampling={"seed": seed, "max_tokens": max_tokens})
        for seed in range(8)
    ]
    for frames in run(engine, requests).values():
        assert isinstance(json.loads(choice_text(frames)), dict)
        assert sum(len(f.token_ids) for f in frames if isinstance(f, DeltaFrame)) <= max_tokens


@pytest.mark.parametrize(
    ("prefix", "closed"),
    [
        ("", "{}"),
        ('{"a', '{"a": null}'),
        ('{"a": ', '{"a": null}'),
        ('{"a": "x\\', '{"a": "x\\n"}'),
        ('{"a": "\\u1', '{"a": "\\u1000"}'),
        ('{"a": 1e+', '{"a": 1e+0}'),
        ('{"a": [1, {"b": [', '{"a": [1, {"b": []}]}'),
        ('{"a": 1, ', '{"a": 1, "": null}'),
        ('{"a": "}]\\"", "b": [[], [tru', '{"a": "}]\\"", "b": [[], [true]]}'),
    ],
)
def test_the_closing_of_a_json_prefix_is_the_shortest_that_parses(prefix: str, closed: str) -> None:
    assert prefix + closing_text(prefix.encode()).decode() == closed
    json.loads(closed)


def test_unsupported_schema_keyword_is_refused_by_name(make_engine: EngineFactory) -> None:
    engine = make_engine()
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(RequestError) as refused:
        engine_request(
            wire("bad", json_schema=schema), engine.tokenizer, model_name="tiny", grammars=engine.grammars
        )
    assert "uniqueItems" in refused.value.message and refused.value.param == "response_format"


def test_grammars_compile_once_per_schema(make_engine: EngineFactory) -> None:
    engine = make_engine()
    for i in range(3):
        engine_request(
            wire(f"g{i}", json_schema=SCHEMAS[1]),
            engine.tokenizer,
            model_name="tiny",
            grammars=engine.grammars,
        )
    registry = engine.metrics.registry
    assert registry.get_sample_value("tern_engine_grammar_compile_seconds_count") == 1
    assert registry.get_sample_value("tern_engine_grammar_cache_hits_total") == 2
    assert registry.get_sample_value("tern_engine_grammar_wait_seconds_count") == 3


def test_required_tool_choice_always_makes_a_valid_call(tool_engine: Any) -> None:
    engine = tool_engine
    parallel = False
    requests = [
        wire(
            f"t{seed}",
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            sampling={"seed": seed},
        )
        for seed in range(5)
    ]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for frames in run(engine, requests).values():
        last = [f for f in frames if isinstance(f, DeltaFrame)][-1]
        assert last.finish_reason == "tool_calls" and last.tool_calls
        assert parallel or len(last.tool_calls) == 1
        for call in last.tool_calls:
            assert call.id.startswith("call_")
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        assert choice_text(frames) == ""  # the call is not content


def test_named_tool_choice_calls_that_function(tool_engine: Any) -> None:
    engine = tool_engine
    choice = {"type": "function", "function": {"name": "get_time"}}
    frames = run(engine, [wire("named", tools=TOOLS, tool_choice=choice, sampling={"seed": 2})])["named"]
    last = [f for f in frames if isinstance(f, DeltaFrame)][-1]
    assert last.tool_calls and {c.name for c in last.tool_calls} == {"get_time"}


def test_tool_choice_none_leaves_the_output_free_and_the_tools_unmentioned(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    request = wire("none", tools=TOOLS, tool_choice="none")
    core = engine_request(request, engine.tokenizer, model_name="tiny", grammars=engine.grammars)
    assert core.grammar is None and core.tool_parser is None
    assert "get_weather" not in engine.tokenizer.decode(core.prompt_token_ids)


@pytest.mark.parametrize("parallel", [False, True])
def test_parallel_tool_calls_decides_whether_a_second_call_may_follow(
    tool_engine: Any, parallel: bool
) -> None:
    grammars = tool_engine.grammars
    tools = [ToolSpec.model_validate(t) for t in TOOLS]
    grammar = grammars.compile(
        forced_call_grammar(tools, "required", parallel=parallel, fmt=ToolCallFormat.HERMES), param="tools"
    )
    matcher = grammar.matcher()
    one = '<tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call>'
    assert matcher.consume_tokens(tool_engine.tokenizer.encode(one)) and matcher.is_accepting()
    assert matcher.try_consume_tokens(tool_engine.tokenizer.encode("<tool_call>")) == (11 if parallel else 0)


# -- prompts -----------------------------------------------------------------------------------


def test_templates_without_tool_support_get_the_tools_and_tool_turns_as_text() -> None:
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"unit": "c", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    tools = [ToolSpec.model_validate(t) for t in TOOLS]
    messages, template_tools = prompt_messages(conversation, tools, template_has_tools=False)
    assert template_tools is None
    assert (
        messages[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in messages[0]["content"]
    )
    call = '{"name": "get_weather", "arguments": {"unit": "c", "days": 1}}'
    assert messages[2] == {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"}
    assert messages[3] == {"role": "tool", "content": "18 degrees"}


def test_templates_with_tool_support_get_tools_and_parsed_arguments() -> None:
    conversation = [
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        }
    ]
    messages, template_tools = prompt_messages(
        conversation, [ToolSpec.model_validate(WEATHER)], template_has_tools=True
    )
    assert template_tools == [WEATHER]
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_the_call_format_is_read_from_the_chat_template() -> None:
    assert tool_call_format(None) is ToolCallFormat.HERMES
    assert tool_call_format("{% if tools %}<tool_call>{% endif %}") is ToolCallFormat.HERMES
    assert tool_call_format('{% if tools %}{"name": ..., "parameters": ...}<|python_tag|>{% endif %}') is (
        ToolCallFormat.LLAMA3_JSON
    )


# -- reading calls back ------------------------------------------------------------------------


def feed_all(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[Any]]:
    content = "".join(parser.feed(p) for p in pieces)
    rest, calls = parser.finish()
    return content + rest, calls


def test_hermes_calls_are_found_across_chunk_boundaries() -> None:
    text = 'Let me check.<tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call>'
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    parser = ToolCallParser(NAMES, ToolCallFormat.HERMES)
    streamed = "".join(parser.feed(p) for p in pieces)
    assert streamed == "Let me check."  # nothing of the call leaks into content
    rest, calls = parser.finish()
    assert rest == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"utc": True})]


def test_text_that_is_not_a_valid_call_stays_content() -> None:
    for text in [
        'Maybe <tool_call>{"name": "get_time", "arguments": {"utc": tr',  # cut off
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',  # not a given tool
        "a < b and <tool, not a call",
    ]:
        assert feed_all(ToolCallParser(NAMES, ToolCallFormat.HERMES), [text]) == (text, [])


def test_llama3_json_calls_are_parsed() -> None:
    content, calls = feed_all(
        ToolCallParser(NAMES, ToolCallFormat.LLAMA3_JSON),
        ['{"name": "get_time", ', '"parameters": {"utc": false}}'],
    )
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"utc": False})
    ]
    content, calls = feed_all(ToolCallParser(NAMES, ToolCallFormat.LLAMA3_JSON), ["It is {noon}."])
    assert (content, calls) == ("It is {noon}.", [])


def test_the_mixed_batch_benchmark_checks_batch_independence(make_engine: EngineFactory) -> None:
    result = bench_mixed_batch(make_engine(), rows=2, steps=4, rounds=1)
    assert result["unconstrained_tokens_identical"] is True and result["batch_rows"] == 4
