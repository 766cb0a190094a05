"""RadixAttention prefix cache: a radix tree over token ids whose nodes own KV blocks.

Finished (and partly prefilled) sequences leave their KV blocks in the tree, so a
later request that starts with the same tokens skips that part of its prefill.

Ownership. The tree holds one :class:`BlockAllocator` reference per block it owns;
a sequence that reuses cached blocks takes its own references. A block therefore
returns to the pool only when both the tree has evicted it and no sequence uses it.

Locking. A sequence locks the deepest node it uses (:meth:`RadixCache.lock`); the lock
counts up the whole path, and only unlocked leaves are evicted (least recently used
first), so blocks in use are never evicted.

Pages. The engine's KV cache is paged (``block_size`` tokens per block) and a block
can only be shared whole, so the tree is page-aligned: every node's key is a whole
number of pages and nodes split only at page boundaries. A match that ends mid-block
(a shared system prompt rarely ends on a page boundary) is served by copy-on-write:
:meth:`RadixCache.match_prefix` also reports ``partial_block``, a cached block whose
first ``partial_tokens`` tokens equal the request's next tokens. The caller allocates
a fresh block for the sequence and has the model runner copy the cached block into
it (a whole-block copy is fine: slots past ``partial_tokens`` are overwritten before
they are read); the sequence then writes its own tokens from there on. We chose this
over a page size of 1, which would make every attention read gather token by token.

Namespaces. Each namespace (model or adapter, plus tenant when isolated) has its own
root, so requests in different namespaces never share blocks.

Listening. The tree reports what it gains and loses to an optional :class:`CacheListener`, in its
own terms (namespace, block ids, token ids); the engine owns the listener (KV events for an external
router: engine/cache/kv_events.py), so the tree stays a pure structure.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.cache.block_allocator import BlockAllocator

Page = tuple[int, ...]


@dataclass(eq=False)
class RadixNode:
    """A run of whole pages: ``key`` holds ``len(blocks) * block_size`` token ids."""

    key: Page
    blocks: list[int]
    parent: RadixNode | None
    namespace: Hashable
    children: dict[Page, RadixNode] = field(default_factory=dict)
    """Keyed by each child's first page."""
    lock_ref: int = 0
    last_access: int = 0

    @property
    def is_root(self) -> bool:
        return self.parent is None


@dataclass(frozen=True)
class PrefixMatch:
    num_tokens: int
    """Cached tokens the request can skip: ``len(blocks) * block_size + partial_tokens``."""
    blocks: list[int]
    """Whole cached blocks, in order; the sequence shares them (takes its own references)."""
    last_node: RadixNode
    """Lock this while the sequence uses the match; it protects every block above, ``partial_block`` too."""
    partial_block: int | None = None
    """Copy-on-write source: a cached block whose first ``partial_tokens`` tokens come next."""
    partial_tokens: int = 0


@dataclass(frozen=True)
class CacheStats:
    tree_tokens: int
    tree_blocks: int
    evicted_blocks: int


class CacheListener(Protocol):
    """Told of every change to the set of cached blocks, in the order the changes happen."""

    def blocks_stored(
        self, namespace: Hashable, parent_block: int | None, blocks: Sequence[int], token_ids: Sequence[int]
    ) -> None:
        """``blocks`` now hold ``token_ids`` (``len(blocks)`` whole pages), right after ``parent_block``
        (None: at the namespace's root)."""

    def blocks_removed(self, namespace: Hashable, blocks: Sequence[int]) -> None:
        """``blocks`` left the tree (a leaf's blocks, deepest last)."""

    def cleared(self) -> None:
        """Every block left the tree."""


class RadixCache:
    def __init__(
        self, allocator: BlockAllocator, block_size: int, *, listener: CacheListener | None = None
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.allocator = allocator
        self.block_size = block_size
        self.listener = listener
        self._roots: dict[Hashable, RadixNode] = {}
        self._clock = itertools.count(1)
        self._num_blocks = 0
        self._num_evictable = 0
        self._evicted_blocks = 0

    # ---- lookup -------------------------------------------------------------------

    def match_prefix(self, namespace: Hashable, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of ``token_ids``; refreshes its LRU time.

        Splits the node where the match ends so that ``last_node`` covers exactly the
        matched pages. Callers that must compute at least one token (to get logits)
        pass the prompt without its last token. Hits are counted by the caller, which
        knows whether the request was admitted (the engine's usage and metrics).
        """
        return self._match(namespace, tuple(token_ids))

    def _match(self, namespace: Hashable, tokens: Page) -> PrefixMatch:
        bs = self.block_size
        node = self._roots.get(namespace)
        if node is None:  # nothing cached; an unattached root keeps lock/unlock no-ops
            return PrefixMatch(0, [], RadixNode((), [], None, namespace))
        now = next(self._clock)
        node.last_access = now
        blocks: list[int] = []
        pos = 0
        while pos + bs <= len(tokens):
            child = node.children.get(tokens[pos : pos + bs])
            if child is None:
                break
            pages = self._matching_pages(child.key, tokens, pos)
            if pages < len(child.blocks):
                child = self._split(child, pages)
            child.last_access = now
            blocks.extend(child.blocks)
            pos += len(child.key)
            node = child

        partial_tokens, partial_child = 0, None
        rest = tokens[pos : pos + bs]
        for child in node.children.values():
            common = _common_prefix_len(child.key[:bs], rest)
            if common > partial_tokens:
                partial_tokens, partial_child = common, child
        if partial_child is None:
            return PrefixMatch(pos, blocks, node)
        if len(partial_child.blocks) > 1:
            partial_child = self._split(partial_child, 1)
        partial_child.last_access = now
        source = partial_child.blocks[0]
        return PrefixMatch(pos + partial_tokens, blocks, partial_child, source, partial_tokens)

    # ---- insertion ------------------------------------------------------------------

    def insert(self, namespace: Hashable, token_ids: Sequence[int], blocks: Sequence[int]) -> RadixNode:
        """Cache the whole pages of ``token_ids`` whose KV is in ``blocks``; return the deepest node.

        Pages already cached keep the tree's blocks (the caller keeps and later frees its
        duplicates); the tree takes one reference on each block it newly owns. A trailing
        partial page is not cached.
        """
        bs = self.block_size
        num_pages = len(token_ids) // bs
        if len(blocks) < num_pages:
            raise ValueError(f"{num_pages} full pages need {num_pages} blocks, got {len(blocks)}")
        tokens = tuple(token_ids[: num_pages * bs])
        node = self._root(namespace)
        now = next(self._clock)
        node.last_access = now
        pos = 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos : pos + bs])
            if child is None:
                new_blocks = list(blocks[pos // bs : num_pages])
                self.allocator.incref(new_blocks)
                child = RadixNode(tokens[pos:], new_blocks, node, namespace, last_access=now)
                node.children[child.key[:bs]] = child
                self._num_blocks += len(new_blocks)
                self._num_evictable += len(new_blocks)
                if self.listener is not None:
                    parent_block = None if node.is_root else node.blocks[-1]
                    self.listener.blocks_stored(namespace, parent_block, new_blocks, child.key)
                return child
            pages = self._matching_pages(child.key, tokens, pos)
            if pages < len(child.blocks):
                child = self._split(child, pages)
            child.last_access = now
            pos += len(child.key)
            node = child
        return node

    # ---- locking --------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its ancestors from eviction (counted; pair with :meth:`unlock`)."""
        while not node.is_root:
            if node.lock_ref == 0:
                self._num_evictable -= len(node.blocks)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        while not node.is_root:
            if node.lock_ref <= 0:
                raise ValueError("unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_evictable += len(node.blocks)
            node = node.parent  # type: ignore[assignment]

    # ---- eviction -------------------------------------------------------------------

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks in unlocked nodes: what :meth:`evict` can give back to the pool."""
        return self._num_evictable

    def evict(self, num_blocks: int) -> int:
        """Drop unlocked leaves, least recently used first, until ``num_blocks`` blocks are free again.

        Returns how many blocks went back to the pool (fewer when the tree runs out of
        unlocked leaves).
        """
        start_free = self.allocator.num_free
        target = start_free + num_blocks
        order = itertools.count()  # tie-break so the heap never compares nodes
        heap = [(n.last_access, next(order), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        while heap and self.allocator.num_free < target:
            _, _, leaf = heapq.heappop(heap)
            parent = self._remove_leaf(leaf)
            if parent.is_root:
                if not parent.children:
                    del self._roots[parent.namespace]
            elif not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return self.allocator.num_free - start_free

    def _remove_leaf(self, leaf: RadixNode) -> RadixNode:
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        del parent.children[leaf.key[: self.block_size]]
        self.allocator.decref(leaf.blocks)
        self._num_blocks -= len(leaf.blocks)
        self._num_evictable -= len(leaf.blocks)
        self._evicted_blocks += len(leaf.blocks)
        if self.listener is not None:
            self.listener.blocks_removed(leaf.namespace, leaf.blocks)
        return parent

    def clear(self) -> bool:
        """Drop every cached block (vLLM's prefix-cache reset); refused (False) while a sequence
        holds a lock in the tree, since its blocks would be freed under it."""
        nodes = list(self._nodes())
        if any(node.lock_ref for node in nodes):
            return False
        for node in nodes:
            self.allocator.decref(node.blocks)
        self._evicted_blocks += self._num_blocks
        self._roots.clear()
        self._num_blocks = self._num_evictable = 0
        if self.listener is not None:
            self.listener.cleared()
        return True

    # ---- introspection --------------------------------------------------------------

    def stats(self) -> CacheStats:
        return CacheStats(
            tree_tokens=self._num_blocks * self.block_size,
            tree_blocks=self._num_blocks,
            evicted_blocks=self._evicted_blocks,
        )

    def _nodes(self) -> Iterator[RadixNode]:
        """Every non-root node, depth first."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.is_root:
                yield node

    # ---- helpers --------------------------------------------------------------------

    def _root(self, namespace: Hashable) -> RadixNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = RadixNode((), [], None, namespace)
        return root

    def _matching_pages(self, key: Page, tokens: Page, start: int) -> int:
        """How many whole pages of ``key`` equal ``tokens[start:]``."""
        bs = self.block_size
        pages = min(len(key), len(tokens) - start) // bs
        for p in range(pages):
            if key[p * bs : (p + 1) * bs] != tokens[start + p * bs : start + (p + 1) * bs]:
                return p
        return pages

    def _split(self, node: RadixNode, pages: int) -> RadixNode:
        """Cut ``node`` after ``pages`` pages; return the new upper half (now ``node``'s parent)."""
        assert node.parent is not None and 0 < pages < len(node.blocks)
        cut = pages * self.block_size
        upper = RadixNode(
            node.key[:cut],
            node.blocks[:pages],
            node.parent,
            node.namespace,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        node.parent.children[upper.key[: self.block_size]] = upper
        node.key, node.blocks, node.parent = node.key[cut:], node.blocks[pages:], upper
        upper.children[node.key[: self.block_size]] = node
        return upper


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
