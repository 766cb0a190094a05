"""Per-sequence block tables on top of the reference-counted :class:`BlockAllocator`.

A sequence's ``block_table[i]`` holds its tokens ``i * block_size .. (i + 1) * block_size - 1``.
Blocks are added lazily as the sequence grows and all of them are dropped at
once when it finishes, is aborted or is preempted. Blocks may be shared: the
choices of an ``n > 1`` request share their prompt's full blocks, and a prefix
cache hands out blocks it already holds; every holder owns one reference.

Prefix-cache seam: :meth:`reuse_cached_prefix` (called by the scheduler when it
admits a sequence with nothing computed), :meth:`release` (called when a
sequence gives its blocks back), :meth:`num_reclaimable_blocks` /
:meth:`_reclaim` (blocks a cache could evict to make room) and
:meth:`cache_stats`. Without a prefix cache they are no-ops.

The block manager owns block tables only: it reads a sequence's token counts but
never writes them. What it did that changes them (tokens taken from the cache) it
returns, and the scheduler applies it.

Sliding-window layers (Gemma 3's local layers, ``window``) keep their KV in a pool of their own
(``local``, as many blocks as the main pool, each a page of those layers only): a sequence's
``local_block_table`` pairs a local block with each of its pages, and a page whose every position is
out of the window of the step's first query goes back to the pool as the sequence runs (its entry
becomes -1). A live local block is paired with one live main block (its page's), so the local pool
never runs out first, and its resident memory is what the windows hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.cache.block_allocator import BlockAllocator
from engine.cache.radix_cache import CacheStats
from engine.cache.sequence_view import CachedSequence


@dataclass
class CachedPrefix:
    """What :meth:`BlockManager.reuse_cached_prefix` gave a sequence."""

    num_tokens: int = 0
    """Tokens whose KV the sequence now holds (its new ``num_computed_tokens``)."""
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) whole-block copies to run before the forward (copy-on-write)."""


class BlockManager:
    caches_prefixes = False
    """True when a prefix cache is attached (the scheduler then orders admissions cache-aware)."""

    def __init__(self, allocator: BlockAllocator, block_size: int, *, window: int | None = None) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.allocator = allocator
        self.block_size = block_size
        self.window = window
        """The sliding-window layers' window (None: the model has none)."""
        self.local = BlockAllocator(allocator.num_blocks) if window else None
        """The sliding-window layers' pool's allocator."""

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, seq: CachedSequence, num_new_tokens: int) -> int:
        """Blocks ``seq`` lacks to hold its computed tokens plus ``num_new_tokens``."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: CachedSequence, num_new_tokens: int, *, reserve: int = 0) -> bool:
        """Whether ``num_new_tokens`` more fit, leaving ``reserve`` blocks to spare."""
        missing = self.num_missing_blocks(seq, num_new_tokens)
        return missing + reserve <= self.num_free_blocks + self.num_reclaimable_blocks()

    def allocate(self, seq: CachedSequence, num_new_tokens: int) -> None:
        """Grow ``seq.block_table`` for ``num_new_tokens`` more tokens (raises NoFreeBlocksError)."""
        missing = self.num_missing_blocks(seq, num_new_tokens)
        if missing > 0:
            if missing > self.num_free_blocks:
                self._reclaim(missing - self.num_free_blocks)
            seq.block_table.extend(self.allocator.allocate(missing))
        if self.local is not None:
            self._slide_window(seq)

    def _slide_window(self, seq: CachedSequence) -> None:
        """A local block for each new page; the pages before the window of the step's first query
        (position ``num_computed_tokens``) freed."""
        assert self.local is not None and self.window is not None
        table = seq.local_block_table
        if len(table) < len(seq.block_table):
            self._reuse_local_before_growing(len(seq.block_table) - len(table))
            table.extend(self.local.allocate(len(seq.block_table) - len(table)))
        first_page = max(0, seq.num_computed_tokens - self.window + 1) // self.block_size
        out = [b for b in table[:first_page] if b >= 0]
        if out:
            self.local.decref(out)
            table[:first_page] = [-1] * first_page

    def num_local_blocks(self, seq: CachedSequence) -> int:
        """The sliding-window blocks ``seq`` holds (those inside its window)."""
        return sum(b >= 0 for b in seq.local_block_table)

    def trim(self, seq: CachedSequence) -> None:
        """Give back blocks beyond what ``seq``'s tokens need (those only rejected drafts wrote to).
        They hold no computed token, so no cache has them: a plain decref frees them."""
        keep = self.blocks_for(seq.num_tokens)
        if len(seq.block_table) > keep:
            self.allocator.decref(seq.block_table[keep:])
            del seq.block_table[keep:]
        self._drop_local(seq, keep)

    def share(self, seq: CachedSequence, blocks: list[int]) -> None:
        """Give ``seq`` a reference to ``blocks``, which already hold its first tokens."""
        if seq.block_table:
            raise ValueError("can only share blocks into a sequence that holds none")
        self.allocator.incref(blocks)
        seq.block_table = list(blocks)

    def free(self, seq: CachedSequence) -> None:
        """Drop the sequence's references; its KV is gone (the scheduler resets what it counts)."""
        self.release(seq)
        self.allocator.decref(seq.block_table)
        seq.block_table = []
        self._drop_local(seq, 0)

    def _drop_local(self, seq: CachedSequence, keep: int) -> None:
        if self.local is not None and len(seq.local_block_table) > keep:
            self.local.decref(b for b in seq.local_block_table[keep:] if b >= 0)
            del seq.local_block_table[keep:]

    # -- prefix-cache seam (no-ops without a cache) ----------------------------------------

    def cached_prefix_len(self, seq: CachedSequence) -> int:
        """Tokens of ``seq`` that admitting it now would take from the cache."""
        return 0

    def reuse_cached_prefix(self, seq: CachedSequence) -> CachedPrefix:
        """Adopt cached blocks for the start of ``seq``; return how many tokens they hold."""
        return CachedPrefix()

    def release(self, seq: CachedSequence) -> None:
        """Called before ``seq`` drops its blocks, so a cache can keep what it computed."""

    def num_reclaimable_blocks(self) -> int:
        return 0

    def _reclaim(self, num_blocks: int) -> None:
        """Make ``num_blocks`` more blocks free, e.g. by evicting cached prefixes."""

    def _reuse_local_before_growing(self, num_new_blocks: int) -> None:
        """Before ``num_new_blocks`` sliding-window blocks are taken: a cache may free local blocks
        it alone holds, so that written ones are handed out before never-written ones."""

    def cache_stats(self) -> CacheStats | None:
        """The prefix cache's figures for the metrics; None without one."""
        return None
