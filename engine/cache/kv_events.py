"""The radix cache's changes as vLLM's KV events, for a router that tracks which blocks each engine holds
(llm-d's precise prefix-cache scorer; docs/operations.md).

:class:`KVEventLog` is the tree's :class:`~engine.cache.radix_cache.CacheListener`: it turns each change
into vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` and hands them, one batch per
engine step (vLLM's ``KVEventBatch``), to whatever sends them on (engine/serving/kv_publisher.py).
It runs on the engine's step thread, between steps, like the tree itself.

Wire shape: vLLM's msgspec structs are ``array_like`` and tagged, so an event is a msgpack array that
starts with its class name, fields in declaration order:

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]``
- ``["BlockRemoved", block_hashes, medium]``
- ``["AllBlocksCleared"]``

and a batch is ``[ts, events, data_parallel_rank]``. Block hashes are Tern's own (64-bit, chained from
the namespace through every page before): consumers re-derive their keys from ``token_ids`` and need
only that a hash names the same block in ``BlockStored`` and ``BlockRemoved``, and that a parent hash
names a block stored before.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

MEDIUM = "GPU"
"""vLLM's name for the engine's own KV pool (what it evicts from), as against an offload tier. Tern's
pool is in RAM on a CPU engine, but it plays that part: llm-d weighs the tier it is told, and "cpu"
would mark the blocks as an offload copy."""

Event = list[Any]
EventBatch = list[Any]
"""``[ts, events, data_parallel_rank]``."""


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def root_hash(namespace: Hashable) -> int:
    """The chain's start for a namespace: different models and isolated tenants never share a hash."""
    return _hash(repr(namespace).encode())


def page_hash(parent: int, token_ids: Sequence[int]) -> int:
    return _hash(parent.to_bytes(8, "big") + b"".join(t.to_bytes(4, "little") for t in token_ids))


class KVEventLog:
    """Collects a step's cache changes as vLLM events; :meth:`flush` hands them on as one batch."""

    def __init__(
        self, block_size: int, send: Callable[[EventBatch], None], *, clock: Callable[[], float] = time.time
    ) -> None:
        self.block_size = block_size
        self._send = send
        self._clock = clock
        self._hashes: dict[int, int] = {}
        """Block id -> its hash, for every block the tree holds (a block is in the tree once)."""
        self._pending: list[Event] = []

    # -- CacheListener -----------------------------------------------------------------------

    def blocks_stored(
        self, namespace: Hashable, parent_block: int | None, blocks: Sequence[int], token_ids: Sequence[int]
    ) -> None:
        bs = self.block_size
        parent_hash = None if parent_block is None else self._hashes.get(parent_block)
        chain = root_hash(namespace) if parent_hash is None else parent_hash
        hashes = []
        for i, block in enumerate(blocks):
            chain = page_hash(chain, token_ids[i * bs : (i + 1) * bs])
            self._hashes[block] = chain
            hashes.append(chain)
        self._pending.append(["BlockStored", hashes, parent_hash, list(token_ids), bs, None, MEDIUM, None])

    def blocks_removed(self, namespace: Hashable, blocks: Sequence[int]) -> None:
        hashes = [self._hashes.pop(block) for block in blocks if block in self._hashes]
        if hashes:
            self._pending.append(["BlockRemoved", hashes, MEDIUM])

    def cleared(self) -> None:
        self._hashes.clear()
        self._pending.append(["AllBlocksCleared"])

    # -- batching ------------------------------------------------------------------------------

    def flush(self) -> None:
        """Send what changed since the last flush as one batch (nothing when nothing changed)."""
        if self._pending:
            events, self._pending = self._pending, []
            self._send([self._clock(), events, 0])
