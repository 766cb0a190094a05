"""llguidance against xgrammar on the default model's vocabulary: why the engine uses llguidance.

Prints one JSON object with, for each library: vocabulary setup (ms), compile + first mask for the
20 schemas of ``bench.engine.structured`` (p50/max ms), and the per-token cost of mask + advance
while following a 170-token JSON document (µs). xgrammar is not a dependency of Tern: install it
next to the engine to run this (``pip install xgrammar``); without it only llguidance is measured.

    python -m bench.engine.grammar_libraries
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import llguidance
import numpy as np

from bench.engine.structured import schemas
from engine.loader.load import load_tokenizer
from engine.structured.grammar import lark_json
from engine.tokenizer import Tokenizer

DOCUMENT_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
            },
        }
    },
}
DOCUMENT = json.dumps({"items": [{"sku": "abc-123", "qty": 4}, {"sku": "x", "qty": 12}] * 5})


def _ms(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


def measure_llguidance(tokenizer: Tokenizer, vocab: int) -> dict[str, Any]:
    holder: dict[str, llguidance.LLTokenizer] = {}
    setup = _ms(
        lambda: holder.setdefault(
            "t",
            llguidance.LLTokenizer(
                tokenizer.backend.to_str(), n_vocab=vocab, eos_token=list(tokenizer.eos_token_ids)
            ),
        )
    )
    ll = holder["t"]
    mask = np.empty((vocab + 31) // 32, dtype=np.int32)

    def compile_first_mask(schema: dict[str, Any]) -> None:
        matcher = llguidance.LLMatcher(
            ll, llguidance.LLMatcher.grammar_from_lark(lark_json(schema)), log_level=0
        )
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)

    compile_ms = [_ms(lambda s=s: compile_first_mask(s)) for s in schemas()]
    matcher = llguidance.LLMatcher(
        ll, llguidance.LLMatcher.grammar_from_json_schema(DOCUMENT_SCHEMA), log_level=0
    )
    ids = tokenizer.encode(DOCUMENT)

    def follow() -> None:
        for token in ids:
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            matcher.consume_token(token)

    return _result(setup, compile_ms, _ms(follow) * 1000 / len(ids))


def measure_xgrammar(tokenizer: Tokenizer, vocab: int) -> dict[str, Any]:
    import xgrammar as xgr  # optional: not a Tern dependency

    holder: dict[str, Any] = {}

    def setup() -> None:
        tokens = [tokenizer.backend.id_to_token(i) for i in range(vocab)]
        info = xgr.TokenizerInfo(
            tokens,
            vocab_type=xgr.VocabType.BYTE_LEVEL,
            vocab_size=vocab,
            stop_token_ids=list(tokenizer.eos_token_ids),
        )
        holder["compiler"] = xgr.GrammarCompiler(info, cache_enabled=False)

    setup_ms = _ms(setup)
    compiler = holder["compiler"]
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def compile_first_mask(schema: dict[str, Any]) -> None:
        xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema))).fill_next_token_bitmask(bitmask)

    compile_ms = [_ms(lambda s=s: compile_first_mask(s)) for s in schemas()]
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(DOCUMENT_SCHEMA)))
    ids = tokenizer.encode(DOCUMENT)

    def follow() -> None:
        for token in ids:
            matcher.fill_next_token_bitmask(bitmask)
            matcher.accept_token(token)

    return _result(setup_ms, compile_ms, _ms(follow) * 1000 / len(ids))


def _result(setup_ms: float, compile_ms: list[float], per_token_us: float) -> dict[str, Any]:
    return {
        "vocabulary_setup_ms": round(setup_ms, 1),
        "compile_and_first_mask_ms": {
            "p50": round(statistics.median(compile_ms), 2),
            "max": round(max(compile_ms), 2),
        },
        "mask_and_advance_per_token_us": round(per_token_us, 1),
    }


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    tokenizer = load_tokenizer()
    vocab = tokenizer.backend.get_vocab_size()
    result: dict[str, Any] = {"vocab": vocab, "llguidance": measure_llguidance(tokenizer, vocab)}
    try:
        result["xgrammar"] = measure_xgrammar(tokenizer, vocab)
    except ImportError:
        result["xgrammar"] = "not installed"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
