"""Per-sequence block tables on top of the reference-counted :class:`BlockAllocator`.

A sequence's ``block_table[i]`` holds its tokens ``i * block_size .. (i + 1) * block_size - 1``.
Blocks are added lazily as the sequence grows and all of them are dropped at
once when it finishes, is aborted or is preempted. Blocks may be shared: the
choices of an ``n > 1`` request share their prompt's full blocks, and a prefix
cache hands out blocks it already holds; every holder owns one reference.

Prefix-cache seam: :meth:`reuse_cached_prefix` (called by the scheduler when it
admits a sequence with nothing computed), :meth:`release` (called when a
sequence gives its blocks back) and :meth:`num_reclaimable_blocks` /
:meth:`_reclaim` (blocks a cache could evict to make room). Without a prefix
cache they are no-ops.
"""

from __future__ import annotations

from engine.cache.block_allocator import BlockAllocator
from engine.sequence import Sequence


class BlockManager:
    caches_prefixes = False
    """True when a prefix cache is attached (the scheduler then orders admissions cache-aware)."""

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.allocator = allocator
        self.block_size = block_size

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``seq`` lacks to hold its computed tokens plus ``num_new_tokens``."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        missing = self.num_missing_blocks(seq, num_new_tokens)
        return missing <= self.num_free_blocks + self.num_reclaimable_blocks()

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq.block_table`` for ``num_new_tokens`` more tokens (raises NoFreeBlocksError)."""
        missing = self.num_missing_blocks(seq, num_new_tokens)
        if missing == 0:
            return
        if missing > self.num_free_blocks:
            self._reclaim(missing - self.num_free_blocks)
        seq.block_table.extend(self.allocator.allocate(missing))

    def share(self, seq: Sequence, blocks: list[int], num_tokens: int) -> None:
        """Give ``seq`` a reference to ``blocks``, which already hold its first ``num_tokens`` tokens."""
        if seq.block_table:
            raise ValueError("can only share blocks into a sequence that holds none")
        if num_tokens > len(blocks) * self.block_size:
            raise ValueError("shared blocks cannot hold num_tokens tokens")
        self.allocator.incref(blocks)
        seq.block_table = list(blocks)
        seq.num_computed_tokens = num_tokens

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; its KV is gone, so it must recompute from scratch."""
        self.release(seq)
        self.allocator.decref(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot of the token at ``position``."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    # -- prefix-cache seam (no-ops without a cache) ----------------------------------------

    def cached_prefix_len(self, seq: Sequence) -> int:
        """Tokens of ``seq`` that admitting it now would take from the cache."""
        return 0

    def reuse_cached_prefix(self, seq: Sequence) -> list[tuple[int, int]]:
        """Adopt cached blocks for the start of ``seq``; return (src, dst) block copies to run first."""
        return []

    def release(self, seq: Sequence) -> None:
        """Called before ``seq`` drops its blocks, so a cache can keep what it computed."""

    def num_reclaimable_blocks(self) -> int:
        return 0

    def _reclaim(self, num_blocks: int) -> None:
        """Make ``num_blocks`` more blocks free, e.g. by evicting cached prefixes."""
