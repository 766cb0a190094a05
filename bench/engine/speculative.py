"""Speculative decoding benchmark: output tokens/s with n-gram speculation on against off.

Two workloads on the default model, greedy (so both settings produce the same tokens, which the
benchmark checks):

- ``input_grounded``: the answer copies its input: rewrite a passage, edit a code file, quote
  from a document, repeat a text;
- ``open_ended``: the 16 chat prompts every engine benchmark uses (``bench.engine.PROMPTS``);
- ``structured``: answers from the passage as JSON held to a schema (structured output), where drafts
  the grammar refuses are never proposed and each draft row is masked as a plain step would be.

At 1 stream each prompt runs alone; at ``--streams`` (16) the prompts run together, as one batch.
Settings alternate on the same engine (speculation is switched on the running engine; off/on,
then on/off), after one untimed warm-up batch, so a noisy neighbour hits both alike. Prints one
JSON object: tokens/s per setting, the ratio on/off, the draft acceptance rate.

    python -m bench.engine.speculative [--rounds 2] [--max-tokens 192] [--streams 16] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

from bench.engine import PROMPTS, cpu_model
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import EngineRequest, SamplingParams
from engine.core.speculative import NgramSpeculator
from engine.structured.grammar import Grammar, closed_object

PASSAGE = (
    "The old stone bridge crosses the river at the narrowest point of the valley. It was built in 1792 "
    "by the villagers themselves, who carried every stone from the quarry on the hill. For two centuries "
    "it carried carts, cattle and, later, cars, until a new bridge opened downstream in 1989. Today the "
    "old bridge is for walkers only, and every summer the village holds a market on it.\n\n"
    "The market sells bread, cheese, honey and wool from the farms around the valley. Musicians play "
    "at both ends of the bridge, and children race paper boats under its three arches. When the river "
    "floods in spring, the water rises almost to the keystones, but the bridge has never moved."
)
CODE = '''def add(a, b):
    """Return the sum of a and b."""
    return a + b


def mean(values):
    """Return the arithmetic mean of a list of numbers."""
    total = 0
    for value in values:
        total = add(total, value)
    return total / len(values)
'''


STRUCTURED = [
    (
        f"{PASSAGE}\n\nAnswer in JSON: when was the bridge built, by whom, when did the new bridge open, "
        "and what does the market sell?",
        closed_object(
            built={"type": "integer"},
            builders={"type": "string"},
            new_bridge={"type": "integer"},
            market_sells={"type": "array", "items": {"type": "string"}, "maxItems": 6},
        ),
    ),
    (
        f"Return the text below as JSON, its sentences in a list, word for word:\n\n{PASSAGE}",
        closed_object(sentences={"type": "array", "items": {"type": "string"}, "maxItems": 8}),
    ),
]
INPUT_GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite the following text, replacing the word 'bridge' with 'viaduct' everywhere:\n\n{PASSAGE}",
    f"Rename the function `add` to `plus` in this Python code and return the whole code:\n\n{CODE}",
    f"{PASSAGE}\n\nQuote the sentences of the text above that mention the years 1792 and 1989.",
]


def run_batch(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, grammars: list[Grammar] | None = None
) -> tuple[float, list[list[int]]]:
    """All prompts at once (each held to its grammar, if given); returns the seconds it took and each
    request's tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    requests = [
        EngineRequest(f"r{i}-{time.monotonic_ns()}", p, params, grammar=grammars[i] if grammars else None)
        for i, p in enumerate(prompts)
    ]
    started = time.perf_counter()
    results = engine.generate(requests)
    elapsed = time.perf_counter() - started
    return elapsed, [[t for d in results[r.request_id].deltas for t in d.token_ids] for r in requests]


def measure(
    engine: LLMEngine,
    speculator: NgramSpeculator,
    prompts: list[list[int]],
    *,
    streams: int,
    max_tokens: int,
    rounds: int,
    grammars: list[Grammar] | None = None,
) -> dict[str, Any]:
    seconds = {"on": 0.0, "off": 0.0}
    tokens: dict[str, list[list[int]]] = {"on": [], "off": []}
    metrics = engine.metrics
    drafted = accepted = 0.0
    starts = range(0, len(prompts), streams)
    groups = [(prompts[i : i + streams], grammars[i : i + streams] if grammars else None) for i in starts]
    run_batch(engine, groups[0][0], max_tokens, groups[0][1])  # warm-up: first touch of this many KV pages
    for round_index in range(rounds):
        for setting in ("off", "on") if round_index % 2 == 0 else ("on", "off"):
            engine.speculator = speculator if setting == "on" else None
            before = (metrics.draft_tokens._value.get(), metrics.accepted_draft_tokens._value.get())
            for group, group_grammars in groups:
                elapsed, out = run_batch(engine, group, max_tokens, group_grammars)
                seconds[setting] += elapsed
                tokens[setting].extend(out)
            drafted += metrics.draft_tokens._value.get() - before[0]
            accepted += metrics.accepted_draft_tokens._value.get() - before[1]
    count = sum(len(t) for t in tokens["off"])
    on, off = count / seconds["on"], count / seconds["off"]
    return {
        "streams": streams,
        "output_tokens": count // rounds,
        "tokens_per_s_off": round(off, 1),
        "tokens_per_s_on": round(on, 1),
        "speedup": round(on / off, 3),
        "draft_acceptance": round(accepted / drafted, 3) if drafted else None,
        "identical_tokens": tokens["on"] == tokens["off"],
    }


def warmed_engine(threads: int | None) -> tuple[LLMEngine, NgramSpeculator, list[list[int]], list[list[int]]]:
    """The default engine with n-gram speculation (no prefix cache, so reruns of a prompt cost the
    same) and both workloads as chat prompts, after a warm-up request: input-grounded, open-ended."""
    engine = LLMEngine.from_config(
        EngineConfig(num_threads=threads, enable_prefix_cache=False, speculative="ngram")
    )
    speculator = engine.speculator
    assert speculator is not None  # its per-sequence state lives on each Sequence: one serves all

    def chat(texts: list[str]) -> list[list[int]]:
        return [engine.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]

    grounded = chat(INPUT_GROUNDED)
    run_batch(engine, grounded[:1], 8)
    return engine, speculator, grounded, chat(PROMPTS)


def structured(engine: LLMEngine) -> tuple[list[list[int]], list[Grammar]]:
    """The structured workload's chat prompts and their schemas' grammars."""
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": text}]) for text, _ in STRUCTURED]
    return prompts, [engine.grammars.json_schema(schema) for _, schema in STRUCTURED]


def settings(speculator: NgramSpeculator) -> dict[str, Any]:
    return {
        "num_speculative_tokens": speculator.num_tokens,
        "ngram": [speculator.ngram_min, speculator.ngram_max],
        "max_batch": speculator.max_batch,
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--streams", type=int, default=16, help="the concurrent case (1 stream is always run)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    engine, speculator, grounded, open_ended = warmed_engine(args.threads)
    common = {"max_tokens": args.max_tokens, "rounds": args.rounds}
    structured_prompts, structured_grammars = structured(engine)
    result = {
        "model": engine.model_name,
        "cpu": cpu_model(),
        "settings": settings(speculator),
        "input_grounded_1_stream": measure(engine, speculator, grounded, streams=1, **common),
        "open_ended_1_stream": measure(engine, speculator, open_ended[:6], streams=1, **common),
        "structured_1_stream": measure(
            engine, speculator, structured_prompts, grammars=structured_grammars, streams=1, **common
        ),
        f"open_ended_{args.streams}_streams": measure(
            engine,
            speculator,
            open_ended * (args.streams // len(open_ended) or 1),
            streams=args.streams,
            **common,
        ),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
