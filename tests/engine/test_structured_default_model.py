"""Structured output that parses on the default model (SmolLM2-135M), not only on paper.

The grammar guarantees the shape while the answer lasts; these tests check that answers also end
within ``max_tokens`` (docs/structured-output.md, "Bounded JSON"). Each case samples 20 seeds at
temperature 0.7 with ``max_tokens`` 200, all in one batch, and needs 19 of them to parse and
validate. Before the bounds, the model wrote 190-digit populations on 3 seeds in 20.
The engine's frames are what the gateway streams or gathers into one reply (tests/e2e covers both).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import torch

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.serving.frames import generate_frames
from engine.structured.grammar import closed_object
from engine.structured.json_bounds import INT64_BOUND, BoundedMatcher
from protocol.rpc import DeltaFrame, FinalFrame, GenerateRequest

pytestmark = pytest.mark.slow  # the real default model

SEEDS = range(20)
NEEDED = 19

# The first three are the ones a new user tried (issue 37): a schema with a bounded-below integer,
# the same as the openai SDK writes it for a pydantic ``City`` (integer unbounded, strict), and
# ``json_object`` (any object: before its closing, 7 seeds in 20 nested or listed on until cut).
CITY = closed_object(
    city={"type": "string"}, country={"type": "string"}, population={"type": "integer", "minimum": 0}
)
CITY_FROM_PYDANTIC = {
    "title": "City",
    "type": "object",
    "properties": {
        "city": {"title": "City", "type": "string"},
        "country": {"title": "Country", "type": "string"},
        "population": {"title": "Population", "type": "integer"},
    },
    "required": ["city", "country", "population"],
    "additionalProperties": False,
}
FRUITS = closed_object(
    fruits={
        "type": "array",
        "items": closed_object(name={"type": "string"}, calories={"type": "integer"}),
        "minItems": 2,
        "maxItems": 4,
    }
)
SENTIMENT = closed_object(
    sentiment={"enum": ["positive", "negative", "neutral"]},
    confidence={"type": "number", "minimum": 0, "maximum": 1},
)
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "city": (CITY, "Describe Paris."),
    "city_from_pydantic": (CITY_FROM_PYDANTIC, "Describe Paris."),
    "json_object": ({"type": "object"}, "Give me a JSON object about cats."),
    "fruits": (FRUITS, "List some fruits with their calories."),
    "sentiment": (SENTIMENT, "Classify the sentiment of: 'I loved this movie!'"),
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": closed_object(city={"type": "string"}, days={"type": "integer"}),
    },
}


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    threads = torch.get_num_threads()
    yield LLMEngine.from_config(EngineConfig(num_threads=1, max_num_seqs=len(SEEDS) * (len(CASES) + 1)))
    torch.set_num_threads(threads)


def sampled(tag: str, seed: int, prompt: str, **fields: Any) -> GenerateRequest:
    return GenerateRequest.model_validate(
        {
            "request_id": f"{tag}-{seed}",
            "messages": [{"role": "user", "content": prompt}],
            "sampling": {"temperature": 0.7, "max_tokens": 200, "seed": seed},
        }
        | fields
    )


def text_of(frames: list[DeltaFrame | FinalFrame]) -> str:
    return "".join(f.text for f in frames if isinstance(f, DeltaFrame))


def validates(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_schemas_and_a_forced_tool_call_parse_in_19_of_20_seeds(engine: LLMEngine) -> None:
    requests = [
        sampled(name, seed, prompt, json_schema=schema)
        for name, (schema, prompt) in CASES.items()
        for seed in SEEDS
    ]
    requests += [
        sampled(
            "tool",
            seed,
            "What's the weather in Paris for the next 3 days?",
            tools=[WEATHER_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
        )
        for seed in SEEDS
    ]
    frames = generate_frames(engine, requests)  # one batch: every seed of every case at once
    failures: dict[str, list[str]] = {}
    for name, (schema, _) in CASES.items():
        for seed in SEEDS:
            text = text_of(frames[f"{name}-{seed}"])
            if not validates(text, schema):
                failures.setdefault(name, []).append(text[:120])
    parameters = WEATHER_TOOL["function"]["parameters"]  # type: ignore[index]
    for seed in SEEDS:
        calls = [c for f in frames[f"tool-{seed}"] if isinstance(f, DeltaFrame) for c in f.tool_calls or []]
        if len(calls) != 1 or calls[0].name != "get_weather" or not validates(calls[0].arguments, parameters):
            failures.setdefault("tool", []).append(text_of(frames[f"tool-{seed}"])[:120])
    too_many = {name: texts for name, texts in failures.items() if len(texts) > len(SEEDS) - NEEDED}
    assert not too_many, json.dumps(too_many, indent=1)


def test_an_integer_without_bounds_stays_within_int64_and_a_number_within_double(engine: LLMEngine) -> None:
    """What the grammar lets through, token by token: a 19-digit integer and no more, a number of 17
    significant digits and a 3-digit exponent and no more."""
    tokenizer = engine.tokenizer

    def accepts(schema: dict[str, Any], text: str) -> bool:
        matcher: BoundedMatcher = engine.grammars.json_schema(schema).matcher()
        ids = tokenizer.encode(text)
        return matcher.validate_tokens(ids) == len(ids)

    integer = closed_object(n={"type": "integer"})
    assert accepts(integer, f'{{"n": {INT64_BOUND}}}') and accepts(integer, f'{{"n": -{INT64_BOUND}}}')
    assert not accepts(integer, f'{{"n": {INT64_BOUND + 1}')
    assert not accepts(integer, '{"n": 12345678901234567890')
    number = closed_object(x={"type": "number"})
    assert accepts(number, '{"x": 1234567890123456789}') and accepts(number, '{"x": 0.12345678901234567}')
    assert accepts(number, '{"x": 1.2345678901234567e-308}')
    assert not accepts(number, '{"x": 12345678901234567890')
    assert not accepts(number, '{"x": 1.23456789012345678')
    assert not accepts(number, '{"x": 0.000000000000000001')
    assert not accepts(number, '{"x": 1e1234')
    assert accepts({"type": "object"}, '{"n": 1234567890123456789}'), "json_object: the same bounds"
    assert not accepts({"type": "object"}, '{"n": 12345678901234567890')
    text = closed_object(s={"type": "string"})
    assert accepts(text, '{"s": "12345678901234567890123"}'), "digits in strings are not numbers"
    assert accepts(text, '{"s": "a\\"12345678901234567890123"}'), "nor after an escaped quote"
