"""Prompts that tokenize to more (or fewer) tokens than 4 bytes a token, for the budget and TPM tests
against the real engine: short messages under the default model's long template, a 2k-token system
prompt, tool definitions, non-Latin scripts and ``n`` > 1. Each request's exact prompt count is what
the engine's own tokenizer and template make of it (``engine.serving.requests.tokenize``)."""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from decimal import Decimal
from functools import cache
from typing import Any

from engine.loader import gguf_file
from engine.loader.load import default_model_path
from engine.serving.requests import tokenize
from engine.tokenizer import Tokenizer
from gateway.budgets.rules import PRICE_SCALE, nano_cost
from protocol.openai.requests import ChatCompletionRequest

MODEL = "SmolLM2-135M-Instruct"

SYSTEM_2K = " ".join(
    f"Rule {i}: when asked about topic {i * 7 % 97}, answer in {i % 5 + 1} short sentences."
    for i in range(94)
)
"""About 1,900 tokens: with its answer it fits a 2,000 tokens/minute limit alone, barely."""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"lookup_{name}",
            "description": f"Look up the {name} of a place, with units and the time it was measured.",
            "parameters": {
                "type": "object",
                "properties": {
                    "place": {"type": "string", "description": "city and country"},
                    "unit": {"type": "string", "enum": ["metric", "imperial"]},
                },
                "required": ["place"],
            },
        },
    }
    for name in ("weather", "tide", "wind")
]

SCRIPTS = [
    "写一首关于大海的诗，第{i}首，要有波浪和月光。",
    "Напиши стихотворение о море, номер {i}, с волнами и луной.",
    "اكتب قصيدة عن البحر رقم {i} مع الأمواج والقمر.",
    "海についての詩を書いてください、{i}番目、波と月で。",
    "समुद्र के बारे में कविता लिखो, संख्या {i}, लहरों और चाँद के साथ।",
]

KINDS = ("short", "system", "tools", "script", "n")


@cache
def engine_tokenizer() -> Tokenizer:
    """The default model's tokenizer and chat template, read from its GGUF (no weights)."""
    reader = gguf_file.open_gguf(default_model_path())
    return Tokenizer.from_gguf_metadata(gguf_file.read_metadata(reader))


def exact_prompt_tokens(body: dict[str, Any]) -> int:
    """What the engine prefills for this chat body: template, tools, system prompt and all."""
    request = ChatCompletionRequest.model_validate(body).to_generate_request(request_id=uuid.uuid4().hex)
    return len(tokenize(request, engine_tokenizer()))


def draw_body(rng: random.Random, i: int, *, stream: bool = True) -> dict[str, Any]:
    kind = KINDS[i % len(KINDS)] if i < len(KINDS) else rng.choice(KINDS)
    user = f"Write a poem about the sea, take {i}"
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(1, 2), "ignore_eos": True}
    if kind == "system":
        body["messages"] = [{"role": "system", "content": SYSTEM_2K}, {"role": "user", "content": user}]
    elif kind == "tools":
        body["messages"] = [{"role": "user", "content": f"What is the weather in city {i}?"}]
        body["tools"] = TOOLS[: rng.randint(1, 3)]
    elif kind == "script":
        body["messages"] = [{"role": "user", "content": rng.choice(SCRIPTS).format(i=i)}]
    else:
        body["messages"] = [{"role": "user", "content": user}]
        if kind == "n":
            body["n"] = rng.randint(2, 3)
    body["stream"] = stream and rng.random() < 0.3
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class Req:
    key: int
    body: dict[str, Any]
    prompt: int
    """Its exact prompt count."""

    @classmethod
    def draw(cls, rng: random.Random, i: int, keys: int, *, stream: bool = True) -> Req:
        body = draw_body(rng, i, stream=stream)
        return cls(rng.randrange(keys), body, exact_prompt_tokens(body))

    @property
    def completion(self) -> int:
        """With ``ignore_eos`` every choice runs to ``max_tokens``: the worst case is what is billed."""
        return int(self.body["max_tokens"]) * int(self.body.get("n", 1))

    @property
    def worst_tokens(self) -> int:
        return self.prompt + self.completion

    def worst_nano(self, prices: tuple[Decimal, Decimal]) -> int:
        return cost_nano(prices, self.prompt, self.completion)


def cost_nano(prices: tuple[Decimal, Decimal], prompt: int, completion: int) -> int:
    """What the gateway bills (cached prompt tokens cost as much as the others here)."""
    p, c = (int(x * PRICE_SCALE) for x in prices)
    return nano_cost(p, p, c, prompt=prompt, cached=0, completion=completion)
