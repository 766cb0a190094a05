"""Reference-counted allocator over the fixed pool of KV-cache blocks.

Every holder of a block (a running sequence, the prefix cache) owns one
reference; a block returns to the free list when its last reference goes.

The free list is a stack: the block freed last is handed out first, and a block never used before
only when every used one is taken. The pool is a mapping of zero pages that cost memory once written
(``model_runner._zeroed_pool``), so its resident part stays the most blocks ever in use at once; a
queue handed out every block of the pool in turn, and a 64-request run left all of it resident
(188 MB for the default model where 80 MB were ever needed at once: docs/engine.md, "Memory").
Blocks are first handed out in index order, so the blocks ever written are ``0 .. num_written - 1``
and the never-written ones are the bottom of the stack.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class NoFreeBlocksError(RuntimeError):
    """The pool cannot satisfy an allocation; the caller should wait, evict or preempt."""


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self._refcounts = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 on top
        self.num_written = 0
        """Blocks ever handed out: the pool's resident part (its other pages were never touched)."""
        self._dirty = [False] * num_blocks
        """Blocks handed out since their pages were last given back (:meth:`take_free_dirty`)."""
        self.on_free: Callable[[int], None] | None = None
        """Called with each block whose last reference goes (the prefix cache lets go of the
        sliding-window blocks it kept beside it)."""

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_free_written(self) -> int:
        """Free blocks written before: handed out ahead of never-written ones, at no memory cost."""
        return len(self._free) - (self.num_blocks - self.num_written)

    def refcount(self, block: int) -> int:
        return self._refcounts[block]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with one reference, or raise without taking any."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._refcounts[b] = 1
            self._dirty[b] = True
            self.num_written = max(self.num_written, b + 1)
        return blocks

    def take_free_dirty(self) -> list[int]:
        """The free blocks written since their pages were last given back, now counted clean: the
        engine, idle, hands their pages back (``ModelRunner.release_free_blocks``)."""
        blocks = [b for b in self._free if self._dirty[b]]
        for b in blocks:
            self._dirty[b] = False
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self._refcounts[b] <= 0:
                raise ValueError(f"block {b} is free; cannot share it")
            self._refcounts[b] += 1

    def decref(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero become free."""
        for b in blocks:
            if self._refcounts[b] <= 0:
                raise ValueError(f"block {b} is already free")
            self._refcounts[b] -= 1
            if self._refcounts[b] == 0:
                self._free.append(b)
                if self.on_free is not None:
                    self.on_free(b)
