"""What the cache knows of a sequence: its tokens, how many are computed, and the blocks it holds.

The scheduler's ``engine.core.sequence.Sequence`` has these fields among many; the cache reads
them through this view only, so ``engine/cache`` imports nothing above it. The block manager
writes ``block_table`` and a prefix cache ``prefix_handle``; token counts it only reads.
"""

from __future__ import annotations

from typing import Protocol


class CachedSequence(Protocol):
    token_ids: list[int]
    """Prompt followed by the generated tokens."""
    num_computed_tokens: int
    """Tokens whose K/V are in the cache."""
    block_table: list[int]
    local_block_table: list[int]
    """The blocks of the sliding-window layers' own pool, page by page as ``block_table``; -1 for a page
    that fell out of the window and was freed (empty for a model without such layers)."""
    cache_namespace: str | None
    """Sequences with different namespaces never share prefix-cache blocks."""
    prefix_handle: object | None
    """Opaque state a prefix cache attaches (e.g. its locked tree node); released on free."""

    @property
    def num_tokens(self) -> int: ...
