"""Structured-output benchmark: grammar compile time, the cache-hit path, and what masks cost a batch.

Prints one JSON object:

- ``compile``: 20 distinct JSON schemas (nested objects, arrays, enums, bounded numbers,
  optional fields, patterns, formats) compiled on a cold cache: p50/p99/max in ms, the one-off
  vocabulary setup, and the cache-hit path (the same 20 again) p50/p99;
- ``bounds_per_token``: what the number bounds add to each constrained token (mask + advance, µs),
  llguidance's matcher alone against the wrapped one, on an answer of 60 numbers;
- ``mixed_batch``: decode steps of a batch of unconstrained greedy rows alone, and with the
  same number of extra rows held to a grammar (a long string; ``mixed_batch_numbers``: an array
  of numbers, where the number bounds of ``engine/structured/json_bounds.py`` work every step).
  Both batches are the same size: ``rows`` unconstrained + ``rows`` more unconstrained, or +
  ``rows`` constrained. It reports the step time of each, their ratio, and whether the
  unconstrained rows produced the same tokens in both (batch independence). Steps are
  interleaved A/B and the median is reported. On a busy machine that ratio moves by ±10% from
  run to run, so it also reports the time the masks themselves took per step, the part of the
  difference that is structured output's.

    python -m bench.engine.structured [--rows 8] [--steps 16] [--rounds 4] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from engine.config import EngineConfig
from engine.core import sampler
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import EngineRequest, SamplingParams
from engine.structured.grammar import GrammarCompiler


def schemas() -> list[dict[str, Any]]:
    """20 schemas of different shapes; each made distinct by its title so none is a cache hit."""
    string = {"type": "string", "maxLength": 40}
    shapes: list[dict[str, Any]] = [
        {
            "type": "object",
            "properties": {"name": string, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        },
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "items": {"type": "object", "properties": {"sku": string, "qty": {"type": "integer"}}},
                    "maxItems": 10,
                }
            },
        },
        {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}, "score": {"type": "number"}},
        },
        {
            "type": "object",
            "properties": {
                "a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": string}}}}
            },
        },
        {
            "type": "object",
            "properties": {
                "email": {"type": "string", "format": "email"},
                "when": {"type": "string", "format": "date-time"},
            },
        },
        {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}},
        {
            "type": "object",
            "properties": {"note": {"anyOf": [string, {"type": "null"}]}, "ok": {"type": "boolean"}},
        },
        {
            "type": "object",
            "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c", "d"]}, "minItems": 1}},
            "$defs": {"unused": string},
        },
        {
            "type": "object",
            "properties": {"node": {"$ref": "#/$defs/node"}},
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "value": {"type": "integer"},
                        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
                    },
                }
            },
        },
        {
            "type": "object",
            "properties": {
                f"field_{i}": {"type": "integer", "minimum": i, "maximum": 10 * i + 9} for i in range(12)
            },
        },
    ]
    out = []
    for i in range(20):
        schema = dict(shapes[i % len(shapes)])
        schema["title"] = f"schema_{i}"
        schema["required"] = list(schema["properties"])
        schema["additionalProperties"] = False
        out.append(schema)
    return out


def bench_compile(engine: LLMEngine) -> dict[str, Any]:
    compiler = GrammarCompiler(engine.tokenizer, vocab_size=engine.model_config.vocab_size)
    started = time.perf_counter()
    _ = compiler.ll_tokenizer, compiler.number_bounds  # the one-off views of the vocabulary
    setup_ms = (time.perf_counter() - started) * 1000

    def timed(schema: dict[str, Any]) -> float:
        started = time.perf_counter()
        compiler.json_schema(schema).matcher()  # a request's whole wait: compile (or find) and start a parse
        return (time.perf_counter() - started) * 1000

    cold = [timed(s) for s in schemas()]
    warm = [timed(s) for s in schemas()]
    return {
        "schemas": len(cold),
        "vocabulary_setup_ms": round(setup_ms, 1),
        "cold_ms": _summary(cold),
        "cache_hit_ms": _summary(warm),
    }


LONG_TEXT = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 2000}},  # never finishes within the steps
    "required": ["story"],
}
MANY_NUMBERS = {
    "type": "object",
    "properties": {"values": {"type": "array", "items": {"type": "number"}, "minItems": 1000}},
    "required": ["values"],
}
"""Constrained rows that write numbers all along: what the number bounds (json_bounds) cost most."""


def bench_mixed_batch(
    engine: LLMEngine, *, rows: int, steps: int, rounds: int, schema: dict[str, Any] = LONG_TEXT
) -> dict[str, Any]:
    """Same-size batches: unconstrained rows plus more unconstrained rows (A) or constrained ones (B)."""
    grammar = engine.grammars.json_schema(schema)
    prompts = [
        engine.tokenizer.encode_chat([{"role": "user", "content": f"Tell story number {i}."}])
        for i in range(rows)
    ]

    def batch(tag: str, constrained: bool) -> list[EngineRequest]:
        free = [
            EngineRequest(
                f"{tag}-free-{i}", p, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
            )
            for i, p in enumerate(prompts)
        ]
        extra = [
            EngineRequest(
                f"{tag}-extra-{i}",
                p,
                SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True),
                grammar=grammar if constrained else None,
            )
            for i, p in enumerate(prompts)
        ]
        return free + extra

    mask_ms: list[float] = []
    unpatched = sampler.mask_logits

    def timed_mask(*args: Any) -> torch.Tensor:
        started = time.perf_counter()
        try:
            return unpatched(*args)
        finally:
            mask_ms.append((time.perf_counter() - started) * 1000)

    sampler.mask_logits = timed_mask  # type: ignore[assignment]  # benchmark-only timing
    step_ms: dict[str, list[float]] = {"unconstrained": [], "mixed": []}
    tokens: dict[str, dict[str, list[int]]] = {"unconstrained": {}, "mixed": {}}
    for _ in range(rounds):  # interleaved, so a noisy neighbour hits both alike
        for name, constrained in (("unconstrained", False), ("mixed", True)):
            for request in batch(name, constrained):
                engine.add_request(request)
            first_step = True  # the prefill: not a decode step
            while engine.has_unfinished_requests():
                started = time.perf_counter()
                outputs = engine.step()
                elapsed = (time.perf_counter() - started) * 1000
                if not first_step and engine.has_unfinished_requests():
                    step_ms[name].append(elapsed)
                first_step = False
                for out in outputs:
                    if "-free-" in out.request_id:
                        key = out.request_id.split("-", 1)[1]
                        tokens[name].setdefault(key, []).extend(t for d in out.deltas for t in d.token_ids)
    sampler.mask_logits = unpatched
    a = statistics.median(step_ms["unconstrained"])
    b = statistics.median(step_ms["mixed"])
    return {
        "batch_rows": 2 * rows,
        "constrained_rows_in_mixed": rows,
        "decode_steps": steps,
        "rounds": rounds,
        "step_ms_unconstrained_only": round(a, 2),
        "step_ms_mixed": round(b, 2),
        "unconstrained_speed_ratio": round(a / b, 3),
        "grammar_mask_ms_per_step": round(statistics.median(mask_ms), 3),
        "grammar_mask_share_of_step": round(statistics.median(mask_ms) / b, 4),
        "unconstrained_tokens_identical": tokens["unconstrained"] == tokens["mixed"],
    }


def bench_bounds(engine: LLMEngine, *, rounds: int = 5) -> dict[str, Any]:
    """What the number bounds add to each constrained token: mask + advance in microseconds, with
    llguidance's matcher alone (as before the bounds) and wrapped (``BoundedMatcher``), interleaved,
    on an answer of many numbers. The best of ``rounds`` each, so a busy machine's noise falls out."""
    text = '{"values": [' + ", ".join(f"{i * 7919 % 100000 / 7:.6f}" for i in range(60)) + "]}"
    ids = engine.tokenizer.encode(text)
    grammar = engine.grammars.json_schema(
        MANY_NUMBERS | {"properties": {"values": {"type": "array", "items": {"type": "number"}}}}
    )
    words = np.empty((engine.model_config.vocab_size + 31) // 32, dtype=np.int32)

    def per_token_us(bounded: bool) -> float:
        matcher = grammar.matcher()
        raw = matcher.inner  # the same parse without the bounds: the baseline
        started = time.perf_counter()
        for token in ids:
            if bounded:
                matcher.fill_mask(words)
                matcher.consume_token(token)
            else:
                raw.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
                raw.consume_token(token)
        return (time.perf_counter() - started) * 1e6 / len(ids)

    best = {"llguidance_alone_us": float("inf"), "with_bounds_us": float("inf")}
    for _ in range(rounds):
        best["llguidance_alone_us"] = min(best["llguidance_alone_us"], per_token_us(False))
        best["with_bounds_us"] = min(best["with_bounds_us"], per_token_us(True))
    return {
        "tokens": len(ids),
        **{k: round(v, 2) for k, v in best.items()},
        "added_us_per_token": round(best["with_bounds_us"] - best["llguidance_alone_us"], 2),
    }


def _summary(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50": round(statistics.median(ordered), 3),
        "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
        "max": round(ordered[-1], 3),
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8, help="unconstrained rows; the batch has twice as many")
    p.add_argument("--steps", type=int, default=16, help="decode steps per batch")
    p.add_argument("--rounds", type=int, default=4, help="A/B rounds, interleaved")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    engine = LLMEngine.from_config(EngineConfig(num_threads=args.threads, enable_prefix_cache=False))
    result = {
        "model": engine.model_name,
        "threads": torch.get_num_threads(),
        "compile": bench_compile(engine),
        "bounds_per_token": bench_bounds(engine),
        "mixed_batch": bench_mixed_batch(engine, rows=args.rows, steps=args.steps, rounds=args.rounds),
        "mixed_batch_numbers": bench_mixed_batch(
            engine, rows=args.rows, steps=args.steps, rounds=args.rounds, schema=MANY_NUMBERS
        ),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
