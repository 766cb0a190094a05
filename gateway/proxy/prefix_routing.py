"""Prefix-cache-aware routing: send a prompt to the engine most likely to hold its prefix.

An approximate radix tree, as SGLang's router keeps one, flattened into a hash chain: the prompt
(chat messages serialised, text, or token ids) is cut into blocks, and block ``i``'s key hashes
block ``i`` together with block ``i - 1``'s key, so one key stands for the whole prefix up to it.
:class:`PrefixTable` remembers, per engine, the keys of the prompts recently sent there (LRU,
bounded); a prompt's match on an engine is how many of its leading keys that engine holds.

The policy (:meth:`PrefixTable.choose`), balanced against load so one hot prefix cannot melt one
engine: only engines within ``load_slack`` requests in flight of the least-busy one are eligible;
among them the longest match wins if it covers at least ``min_match`` of the prompt; otherwise the
least-busy engine that remembers the fewest prefixes (the most cache to spare) takes it. A hot
prefix that overflows its engine's slack spills to another, which then learns it too.

Tenant isolation (``TERN_PREFIX_CACHE_ISOLATION=tenant``): the chain is seeded with the request's
cache namespace (the tenant id), so a tenant's prompts never match another tenant's prefixes. No
tokenizer runs here: blocks are characters (or token ids) and hashing is Python's, cheap enough
for the hot path and per process (each gateway worker learns from what it routes).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from protocol.openai.messages import ChatMessageIn
from protocol.openai.requests import ChatCompletionRequest, OpenAIRequest

E = TypeVar("E", bound=Hashable)

TEXT_BLOCK_CHARS = 64
"""Characters per block of a text prompt (about 16 tokens of English)."""
ID_BLOCK_TOKENS = 16
MAX_BLOCKS = 512
"""Only a prompt's first blocks are keyed: prefixes are what a cache shares."""


class PromptKeys:
    """A request's prefix keys, computed on first use (never, when one engine is all there is)."""

    def __init__(self, request: OpenAIRequest, *, namespace: str | None) -> None:
        self.request = request
        self.namespace = namespace
        self._keys: list[int] | None = None

    @property
    def keys(self) -> list[int]:
        if self._keys is None:
            self._keys = prefix_keys(self.request, namespace=self.namespace)
        return self._keys


def prefix_keys(request: OpenAIRequest, *, namespace: str | None) -> list[int]:
    """The hash chain of a request's prompt, seeded with its model and cache namespace."""
    blocks: Sequence[Hashable]
    if isinstance(request, ChatCompletionRequest):
        blocks = _blocks("".join(_message_text(m) for m in request.messages), TEXT_BLOCK_CHARS)
    elif isinstance(request.prompt, str):
        blocks = _blocks(request.prompt, TEXT_BLOCK_CHARS)
    else:
        ids, size = request.prompt, ID_BLOCK_TOKENS
        blocks = [tuple(ids[i * size : (i + 1) * size]) for i in range(min(len(ids) // size, MAX_BLOCKS))]
    key = hash((namespace, request.model))
    keys = []
    for block in blocks:
        key = hash((key, block))
        keys.append(key)
    return keys


def _message_text(message: ChatMessageIn) -> str:
    content = message.content
    text = content if isinstance(content, str) else "".join(part.text for part in content or ())
    return f"{message.role}\x00{text}\x01"


def _blocks(text: str, size: int) -> list[str]:
    """Whole blocks only: a partial last block would differ between prompts that share it."""
    end = min(len(text) // size, MAX_BLOCKS) * size
    return [text[i : i + size] for i in range(0, end, size)]


@dataclass(frozen=True, slots=True)
class RoutingParams:
    load_slack: int = 4
    """An engine more than this many requests in flight busier than the least-busy is not eligible."""
    min_match: float = 0.3
    """The share of a prompt's blocks an engine must hold to win on its cache rather than its load."""
    max_keys_per_engine: int = 50_000
    """Remembered prefix blocks per engine (LRU): ~800k tokens of prompts, ~400 bytes each."""


class PrefixTable:
    """Which engine was recently sent which prefix blocks; picks engines for prompts."""

    def __init__(self, params: RoutingParams | None = None) -> None:
        self.params = params or RoutingParams()
        self._holders: dict[int, set[Hashable]] = {}
        self._lru: dict[Hashable, OrderedDict[int, None]] = {}
        self._turn = itertools.count()

    def size(self, engine: Hashable) -> int:
        lru = self._lru.get(engine)
        return len(lru) if lru is not None else 0

    def match(self, keys: Sequence[int], engines: Sequence[E]) -> dict[E, int]:
        """For each engine of ``engines`` that holds some: how many leading ``keys`` it holds."""
        wanted = set(engines)
        matched: dict[E, int] = {}
        for depth, key in enumerate(keys, 1):
            holders = self._holders.get(key)
            if not holders:
                break
            found = False
            for engine in engines:
                if engine in holders and engine in wanted:
                    matched[engine] = depth
                    found = True
            if not found:
                break
        return matched

    def choose(self, keys: Sequence[int], engines: Sequence[E], load: Sequence[int]) -> E:
        """The engine for a prompt with ``keys`` among ``engines`` (``load``: requests in flight each)."""
        least = min(load)
        eligible = [e for e, n in zip(engines, load, strict=True) if n <= least + self.params.load_slack]
        if keys:
            matched = self.match(keys, eligible)
            if matched:
                loads = dict(zip(engines, load, strict=True))
                best = max(matched, key=lambda e: (matched[e], -loads[e]))
                if matched[best] >= self.params.min_match * len(keys):
                    return best
        idle = [e for e, n in zip(engines, load, strict=True) if n == least]
        start = next(self._turn) % len(idle)
        rotated = idle[start:] + idle[:start]
        return min(rotated, key=self.size)

    def insert(self, keys: Sequence[int], engine: Hashable) -> None:
        """``engine`` now holds (or soon will) the prefixes ``keys`` stand for."""
        lru = self._lru.setdefault(engine, OrderedDict())
        # Deepest block first, so a prefix's leading blocks are the most recent: eviction takes
        # leaves before the blocks other prompts share, as a radix tree's does.
        for key in reversed(keys):
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                self._holders.setdefault(key, set()).add(engine)
        while len(lru) > self.params.max_keys_per_engine:
            old, _ = lru.popitem(last=False)
            self._drop(old, engine)

    def forget(self, engine: Hashable) -> None:
        """The engine left the rotation: whatever it cached may be gone when it comes back."""
        for key in self._lru.pop(engine, OrderedDict()):
            self._drop(key, engine)

    def _drop(self, key: int, engine: Hashable) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(engine)
            if not holders:
                del self._holders[key]
