"""The block manager with a prefix cache: sequences reuse and leave behind KV blocks in a radix tree.

It fills the seams of :class:`BlockManager`:

- admission (:meth:`reuse_cached_prefix`): share the longest cached prefix's blocks, lock
  its tree path, and copy-on-write the block where the match ends mid-page;
- growth (:meth:`allocate`): before a sequence computes more, the whole pages it has
  computed since the last time go into the tree (so chunked prefills and decodes become
  reusable as they complete), and the lock moves down to the new deepest node;
- release (:meth:`release`): the same insert, then unlock, before the sequence drops
  its own references (finish, abort and preemption alike: preempted sequences hit
  their own blocks when they are readmitted);
- room (:meth:`num_reclaimable_blocks`, :meth:`_reclaim`): unlocked cached blocks count
  as available, and are evicted (least recently used first) before anything is preempted.

The namespace of a sequence is (model name, request's ``cache_namespace``), so models
and isolated tenants never share blocks.

With sliding-window layers (``window``), a cached page keeps beside it (``_local_of``) the local
block its sequence still held for it when it was inserted, for as long as the tree keeps the page,
or until a sequence needs a local block and none written before is free: then the kept local blocks
no sequence holds go first, least recently inserted or hit first (:meth:`_reuse_local_before_growing`).
Without that, every page a sequence computed kept its local block (pages are inserted as they are
computed, while still in the window), and the local pool's resident part grew with every token,
as if the layers had no window: 16 streams of 4,096 tokens on Gemma-3-1B wrote the local pool's
4,096 blocks, 1.4 GB; now about 650, 223 MB (docs/engine.md, "Gemma-3-1B: 16 streams").
A hit is used only as far as the local blocks of the window before its end are all kept: the
longest such prefix of the match (none when the sequence that computed it had already let them go,
e.g. a prompt longer than the window hit in full: its start is then recomputed). No partial page is
taken for such a model (its local half is not copied).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from engine.cache.block_allocator import BlockAllocator, NoFreeBlocksError
from engine.cache.block_manager import BlockManager, CachedPrefix
from engine.cache.radix_cache import CacheStats, RadixCache, RadixNode
from engine.cache.sequence_view import CachedSequence


@dataclass(eq=False)
class _CacheHandle:
    """What a sequence holds in the tree: its locked node and how many of its tokens are cached."""

    node: RadixNode
    inserted_tokens: int


class PrefixCachingBlockManager(BlockManager):
    caches_prefixes = True

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        *,
        model_name: str,
        resident_blocks: int | None = None,
        window: int | None = None,
    ) -> None:
        super().__init__(allocator, block_size, window=window)
        self._local_of: dict[int, int] = {}
        """A cached page's block -> the sliding-window block kept with it (one reference each)."""
        allocator.on_free = self._forget_local
        self.model_name = model_name
        self.cache = RadixCache(allocator, block_size)
        self.resident_blocks = allocator.num_blocks // 2 if resident_blocks is None else resident_blocks
        """How far the cache lets the written part of the pool grow: past it, a new block is one the
        cache evicts (least recently used) before a never-written one. Without it every new prompt
        took a fresh block while the cache kept the old ones, until the whole pool was resident
        (docs/engine.md, "Resident memory"). Running sequences may still use the whole pool."""

    def namespace(self, seq: CachedSequence) -> tuple[str, str | None]:
        return (self.model_name, seq.cache_namespace)

    def cache_stats(self) -> CacheStats:
        return self.cache.stats()

    def cached_prefix_len(self, seq: CachedSequence) -> int:
        return self.cache.match_prefix(self.namespace(seq), seq.token_ids[:-1]).num_tokens

    def reuse_cached_prefix(self, seq: CachedSequence) -> CachedPrefix:
        # At least the last token is computed, so the step yields logits for it.
        match = self.cache.match_prefix(self.namespace(seq), seq.token_ids[:-1])
        self.cache.lock(match.last_node)
        pages = self._pages_with_window(match.blocks)
        full_tokens = pages * self.block_size
        seq.prefix_handle = _CacheHandle(match.last_node, full_tokens)
        self.share(seq, match.blocks[:pages])
        reused = CachedPrefix(full_tokens)
        if self.local is not None:
            self._share_local(seq, match.blocks[:pages])
        elif match.partial_block is not None and (dst := self._take_one_block()) is not None:
            seq.block_table.append(dst)
            reused.num_tokens += match.partial_tokens
            reused.block_copies.append((match.partial_block, dst))
        return reused

    def allocate(self, seq: CachedSequence, num_new_tokens: int) -> None:
        self._insert_computed(seq)
        self._reuse_before_growing(self.num_missing_blocks(seq, num_new_tokens))
        super().allocate(seq, num_new_tokens)

    def release(self, seq: CachedSequence) -> None:
        self._insert_computed(seq)
        handle = seq.prefix_handle
        if isinstance(handle, _CacheHandle):
            self.cache.unlock(handle.node)
        seq.prefix_handle = None

    def _window_pages(self, pages: int) -> range:
        """The pages whose positions the window of position ``pages * block_size`` reaches back to."""
        assert self.window is not None
        return range(max(0, pages * self.block_size - self.window + 1) // self.block_size, pages)

    def _pages_with_window(self, blocks: list[int]) -> int:
        """How many of a match's pages can be taken: all without local layers, else the most whose
        window's pages all kept their local blocks."""
        if self.local is None:
            return len(blocks)
        pages = len(blocks)
        while pages and any(blocks[p] not in self._local_of for p in self._window_pages(pages)):
            pages -= 1
        return pages

    def _share_local(self, seq: CachedSequence, blocks: list[int]) -> None:
        assert self.local is not None
        window = self._window_pages(len(blocks))
        kept = [self._local_of[blocks[p]] for p in window]
        for p in window:  # hit: the most recently used, the last to be reused
            self._local_of[blocks[p]] = self._local_of.pop(blocks[p])
        self.local.incref(kept)
        seq.local_block_table = [-1] * window.start + kept

    def _keep_local(self, seq: CachedSequence, node: RadixNode) -> None:
        """Keep, beside each tree page on ``node``'s path, the local block ``seq`` has for it."""
        assert self.local is not None
        path: list[list[int]] = []
        walk: RadixNode | None = node
        while walk is not None:
            path.append(walk.blocks)
            walk = walk.parent
        tree_blocks = [b for blocks in reversed(path) for b in blocks]
        for page, block in enumerate(tree_blocks):
            local = seq.local_block_table[page] if page < len(seq.local_block_table) else -1
            if local >= 0 and block not in self._local_of:
                self.local.incref([local])
                self._local_of[block] = local

    def _forget_local(self, block: int) -> None:
        """A main block is free: the local block kept with it (if any) goes too."""
        local = self._local_of.pop(block, None)
        if local is not None and self.local is not None:
            self.local.decref([local])

    def _reuse_local_before_growing(self, num_new_blocks: int) -> None:
        """Free kept local blocks that only the tree holds, oldest first, for as many of
        ``num_new_blocks`` as would otherwise be never-written ones: the local pool's resident part
        stays what the running windows need, the tree keeping what was written anyway."""
        assert self.local is not None
        fresh = num_new_blocks - self.local.num_free_written
        if fresh <= 0:
            return
        only_tree = (b for b, local in self._local_of.items() if self.local.refcount(local) == 1)
        drop = list(itertools.islice(only_tree, fresh))
        for block in drop:
            self.local.decref([self._local_of.pop(block)])

    def num_reclaimable_blocks(self) -> int:
        return self.cache.num_evictable_blocks

    def _reclaim(self, num_blocks: int) -> None:
        self.cache.evict(num_blocks)

    def _reuse_before_growing(self, num_new_blocks: int) -> None:
        """Evict cached blocks for what would take never-written ones past ``resident_blocks``."""
        fresh = num_new_blocks - self.allocator.num_free_written
        over = self.allocator.num_written + fresh - self.resident_blocks
        evict = min(fresh, over, self.num_reclaimable_blocks())
        if evict > 0:
            self._reclaim(evict)

    def _take_one_block(self) -> int | None:
        """A fresh block for copy-on-write, evicting if needed; None when there is none to have.
        No eviction ahead of need here: the block to copy is in a node the match did not lock."""
        try:
            if self.num_free_blocks == 0:
                self._reclaim(1)
            return self.allocator.allocate(1)[0]
        except NoFreeBlocksError:
            return None

    def _insert_computed(self, seq: CachedSequence) -> None:
        """Put the sequence's newly completed whole pages in the tree and lock its new deepest node."""
        handle = seq.prefix_handle
        if not isinstance(handle, _CacheHandle):
            handle = None
        done = seq.num_computed_tokens // self.block_size * self.block_size
        if done == 0 or (handle is not None and done <= handle.inserted_tokens):
            return
        node = self.cache.insert(self.namespace(seq), seq.token_ids[:done], seq.block_table)
        if self.local is not None:
            self._keep_local(seq, node)
        self.cache.lock(node)
        if handle is not None:
            self.cache.unlock(handle.node)
        seq.prefix_handle = _CacheHandle(node, done)
