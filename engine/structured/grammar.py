"""Grammars for constrained decoding, compiled by llguidance and cached by their source.

A :class:`Grammar` is compiled once per distinct source (a JSON schema, or the Lark
grammar of a tool-call format) and kept in a small LRU cache; every constrained
sequence gets its own matcher, a copy of the grammar's pristine one. Compiling
runs in the request handler's worker thread (``engine/serving/requests.py``),
never on the step thread, so a request waiting for its grammar does not hold up
the batch; llguidance releases the GIL while it builds.

Why llguidance and not xgrammar: docs/structured-output.md (measured side by side).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.errors import RequestError
from engine.metrics import EngineMetrics
from engine.structured.json_bounds import BoundedMatcher, NumberBounds, with_integer_bounds
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    import llguidance  # imported when a request first asks for structured output (its 2.3 MB with it)

log = logging.getLogger(__name__)

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
"""What ``json_object`` asks for (``protocol.openai.tools.ANY_JSON_OBJECT`` on the wire)."""

JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""One-line JSON with the spacing models write by habit: no runaway newlines, natural-reading output."""


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar; :meth:`matcher` starts a fresh parse of it for one sequence."""

    source: str
    _pristine: llguidance.LLMatcher
    _bounds: NumberBounds
    closes: bool = False
    """Any JSON object (``json_object``): the answer is closed in time for its token budget."""

    def matcher(self) -> BoundedMatcher:
        return BoundedMatcher(self._pristine.deep_copy(), self._bounds, closes=self.closes)


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer; safe to call from several threads."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        metrics: EngineMetrics | None = None,
        cache_size: int = 256,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._metrics = metrics
        self._cache_size = cache_size
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._number_bounds: NumberBounds | None = None

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (about 0.3 s to build, so built on first use)."""
        import llguidance  # on first use: an engine that serves no structured output never loads it

        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(),
                    n_vocab=self._vocab_size,  # the logits' width, so masks line up with them
                    eos_token=list(self._tokenizer.eos_token_ids),
                )
            return self._ll_tokenizer

    @property
    def number_bounds(self) -> NumberBounds:
        """Each token's bytes, for the number bounds every grammar's matchers keep (json_bounds)."""
        tokenizer = self.ll_tokenizer
        with self._lock:
            if self._number_bounds is None:
                self._number_bounds = NumberBounds.for_tokenizer(tokenizer, self._vocab_size)
            return self._number_bounds

    def json_schema(self, schema: dict[str, Any]) -> Grammar:
        """A grammar for JSON valid against ``schema``; a 400 naming what the schema uses that
        cannot be enforced (rather than silently ignoring it)."""
        grammar = self.compile(lark_json(schema), param="response_format")
        return replace(grammar, closes=True) if schema == ANY_JSON_OBJECT else grammar

    def compile(self, lark: str, *, param: str) -> Grammar:
        started = time.perf_counter()
        try:
            return self._cached_or_built(lark, param=param)
        finally:
            if self._metrics:
                self._metrics.grammar_wait_seconds.observe(time.perf_counter() - started)

    def _cached_or_built(self, lark: str, *, param: str) -> Grammar:
        with self._lock:
            cached = self._cache.get(lark)
            if cached is not None:
                self._cache.move_to_end(lark)
        if cached is not None:
            if self._metrics:
                self._metrics.grammar_cache_hits.inc()
            return cached
        started = time.perf_counter()
        grammar = self._build(lark, param=param)
        if self._metrics:
            self._metrics.grammar_compile_seconds.observe(time.perf_counter() - started)
        with self._lock:
            self._cache[lark] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _build(self, lark: str, *, param: str) -> Grammar:
        import llguidance

        tokenizer = self.ll_tokenizer
        source = llguidance.LLMatcher.grammar_from_lark(lark)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, tokenizer)
        if is_error or messages:  # warnings are keywords it would ignore: refuse those too
            reasons = "; ".join(
                _LOCATION.sub("", m).removeprefix("failed to compile JSON schema: ") for m in messages
            )
            raise RequestError(f"The schema cannot be enforced by structured output: {reasons}", param=param)
        matcher = llguidance.LLMatcher(tokenizer, source, log_level=0)
        if matcher.is_error():
            raise RequestError(f"The schema cannot be used: {matcher.get_error()}", param=param)
        return Grammar(source, matcher, self.number_bounds)


_LOCATION = re.compile(r"^at \d+\(\d+\): ")
"""The position in Tern's own wrapping grammar that llguidance prefixes its messages with."""


def closed_object(**properties: dict[str, Any]) -> dict[str, Any]:
    """An object schema with exactly these properties, all required (what OpenAI's strict mode sends)."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark grammar whose whole output is one JSON value valid against ``schema``."""
    return f"start: %json {json_with_options(schema)}\n"


def json_with_options(schema: dict[str, Any]) -> str:
    """``schema`` as llguidance's ``%json`` takes it: integers bounded (json_bounds), with
    :data:`JSON_OPTIONS` (the caller's own ``x-guidance`` settings win)."""
    options = JSON_OPTIONS | schema.get("x-guidance", {})
    return json.dumps(with_integer_bounds(schema) | {"x-guidance": options}, separators=(",", ":"))


def mask_logits(
    logits: torch.Tensor, rows: list[int], matchers: list[BoundedMatcher], budgets: list[int] | None = None
) -> torch.Tensor:
    """``logits`` with the tokens each matcher forbids set to -inf, on ``rows`` only (others untouched,
    so unconstrained sequences in the batch sample exactly as they would alone); ``budgets``: the
    tokens each row's answer may still take."""
    bits = _mask_words(len(rows), logits.shape[1])
    for j, matcher in enumerate(matchers):
        matcher.fill_mask(bits[j], budgets[j] if budgets else None)
    index = torch.tensor(rows, device=logits.device)
    return logits.index_put((index,), _masked(logits[index], bits))


def mask_draft_rows(
    logits: torch.Tensor, matcher: BoundedMatcher, drafts: list[int], budget: int | None = None
) -> torch.Tensor:
    """The rows of one sequence's verification step (``logits`` [k + 1, V], row ``i`` after
    ``drafts[:i]``), each masked by the grammar's state at its position: what a plain step there would
    mask. The matcher consumes the drafts to get there and rolls them back, so it ends as it began;
    the tokens the step keeps are consumed as they are emitted, like any others."""
    bits = _mask_words(len(drafts) + 1, logits.shape[1])
    consumed = 0
    for i in range(len(drafts) + 1):
        matcher.fill_mask(bits[i], None if budget is None else budget - i)
        if i == len(drafts) or matcher.try_consume_tokens([drafts[i]]) != 1:
            break
        consumed += 1
    # Past a draft the grammar refuses (the speculator proposes none): its row, masked, rejects it, so
    # the rows after it never count.
    bits[consumed + 1 :] = bits[consumed]
    if consumed:
        matcher.rollback(consumed)
    return _masked(logits, bits)


def _mask_words(rows: int, vocab: int) -> np.ndarray:
    """Room for ``rows`` token masks, a bit per token, as llguidance writes them."""
    return np.empty((rows, (vocab + 31) // 32), dtype=np.int32)


def _masked(logits: torch.Tensor, bits: np.ndarray) -> torch.Tensor:
    vocab = logits.shape[1]
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab].view(np.bool_)
    return torch.where(torch.from_numpy(allowed).to(logits.device), logits, float("-inf"))


def grammar_complete(matcher: BoundedMatcher, token_id: int) -> bool:
    """Advance a constrained sequence's grammar by its new token; True once the grammar allows
    nothing more (so the choice ends without spending a step on the end-of-sequence token)."""
    if not matcher.consume_token(token_id):  # cannot happen with the mask applied; end rather than drift
        log.warning("grammar refused token %d: %s", token_id, matcher.get_error())
        return True
    return matcher.is_stopped()
