"""The RadixAttention tree: unit tests of its operations and a hypothesis state machine
that checks block ownership against the allocator's reference counts."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.cache.block_allocator import BlockAllocator
from engine.cache.radix_cache import RadixCache, RadixNode

BS = 4


def make_cache(num_blocks: int = 32) -> tuple[BlockAllocator, RadixCache]:
    allocator = BlockAllocator(num_blocks)
    return allocator, RadixCache(allocator, BS)


def cache_tokens(cache: RadixCache, namespace: str, tokens: list[int]) -> list[int]:
    """What a finished sequence does: allocate blocks, insert them, drop its own references."""
    blocks = cache.allocator.allocate(-(-len(tokens) // BS))
    cache.insert(namespace, tokens, blocks)
    cache.allocator.decref(blocks)
    return blocks


def test_insert_then_match_whole_pages() -> None:
    allocator, cache = make_cache()
    blocks = cache_tokens(cache, "m", list(range(12)))
    match = cache.match_prefix("m", [*range(12), 99])
    assert (match.num_tokens, match.blocks, match.partial_block) == (12, blocks, None)
    assert [allocator.refcount(b) for b in blocks] == [1, 1, 1]


def test_match_splits_node_at_page_boundary() -> None:
    _, cache = make_cache()
    blocks = cache_tokens(cache, "m", list(range(12)))
    match = cache.match_prefix("m", [0, 1, 2, 3, 7, 7, 7, 7])
    assert (match.num_tokens, match.blocks) == (4, blocks[:1])
    upper = match.last_node
    assert upper.key == (0, 1, 2, 3) and upper.blocks == blocks[:1]
    (lower,) = upper.children.values()
    assert lower.key == tuple(range(4, 12)) and lower.blocks == blocks[1:] and lower.parent is upper
    assert cache.stats().tree_blocks == 3


def test_match_ending_mid_block_reports_copy_source() -> None:
    _, cache = make_cache()
    blocks = cache_tokens(cache, "m", list(range(12)))
    match = cache.match_prefix("m", [0, 1, 2, 3, 4, 5, 50, 51])
    assert match.num_tokens == 6
    assert match.blocks == blocks[:1]
    assert (match.partial_block, match.partial_tokens) == (blocks[1], 2)
    # The lock target is the one-page node holding the copy source, so locking it protects exactly that.
    assert match.last_node.blocks == [blocks[1]]


def test_query_shorter_than_a_page_can_still_hit() -> None:
    _, cache = make_cache()
    blocks = cache_tokens(cache, "m", [5, 6, 7, 8])
    match = cache.match_prefix("m", [5, 6, 7])
    assert (match.num_tokens, match.blocks) == (3, [])
    assert (match.partial_block, match.partial_tokens) == (blocks[0], 3)


def test_insert_skips_trailing_partial_page() -> None:
    allocator, cache = make_cache()
    blocks = allocator.allocate(3)
    cache.insert("m", list(range(10)), blocks)
    assert cache.stats().tree_blocks == 2
    assert [allocator.refcount(b) for b in blocks] == [2, 2, 1]


def test_insert_dedups_existing_pages() -> None:
    allocator, cache = make_cache()
    first = cache_tokens(cache, "m", list(range(8)))
    second = allocator.allocate(3)
    node = cache.insert("m", list(range(12)), second)
    assert cache.stats().tree_blocks == 3
    assert node.blocks == [second[2]] and node.parent is not None and node.parent.blocks == first
    # Only the new page's block gained a tree reference.
    assert [allocator.refcount(b) for b in second] == [1, 1, 2]


def test_namespaces_never_share() -> None:
    allocator, cache = make_cache()
    cache_tokens(cache, "model-a", list(range(8)))
    assert cache.match_prefix("model-b", list(range(8))).num_tokens == 0
    other = cache_tokens(cache, "model-b", list(range(8)))
    assert cache.match_prefix("model-b", list(range(9))).blocks == other
    assert cache.stats().tree_blocks == 4
    assert allocator.num_free == 28


def test_evict_takes_least_recently_used_leaf_first() -> None:
    _, cache = make_cache()
    old = cache_tokens(cache, "m", [1] * 4)
    middle = cache_tokens(cache, "m", [2] * 4)
    new = cache_tokens(cache, "m", [3] * 4)
    cache.match_prefix("m", [1] * 4)  # touch: now the most recent
    assert cache.evict(1) == 1
    assert cache.match_prefix("m", [2] * 4).num_tokens == 0
    assert cache.evict(1) == 1
    assert cache.match_prefix("m", [3] * 4).num_tokens == 0
    assert cache.match_prefix("m", [1] * 4).blocks == old
    assert cache.stats().evicted_blocks == 2
    assert middle != new


def test_evict_prunes_leaves_before_their_parents() -> None:
    allocator, cache = make_cache()
    cache_tokens(cache, "m", list(range(8)))
    cache_tokens(cache, "m", [0, 1, 2, 3, 9, 9, 9, 9])  # splits: shared page with two children
    assert cache.evict(1) == 1
    assert cache.match_prefix("m", [0, 1, 2, 3]).num_tokens == 4  # the shared parent survives
    assert cache.evict(100) == 2
    assert allocator.num_free == 32 and cache.stats().tree_blocks == 0


def test_locked_nodes_survive_eviction() -> None:
    allocator, cache = make_cache()
    cache_tokens(cache, "m", list(range(12)))
    cache_tokens(cache, "m", [7] * 8)
    match = cache.match_prefix("m", list(range(8)))
    cache.lock(match.last_node)
    assert cache.num_evictable_blocks == 3  # the [7] run and the unlocked tail page
    assert cache.evict(100) == 3
    assert cache.match_prefix("m", list(range(8))).num_tokens == 8
    cache.unlock(match.last_node)
    with pytest.raises(ValueError):
        cache.unlock(match.last_node)
    assert cache.evict(100) == 2
    assert allocator.num_free == 32


# ---- property tests ------------------------------------------------------------------------

PREFIXES = [(), (1, 2, 1, 2, 1), (1, 2, 1, 2, 1, 0, 0, 2, 2), (2, 2, 2)]
token_lists = st.builds(
    lambda prefix, suffix: list(prefix) + suffix,
    st.sampled_from(PREFIXES),
    st.lists(st.integers(0, 2), max_size=7),
).filter(lambda tokens: len(tokens) >= 1)


@dataclass
class SimSequence:
    namespace: str
    tokens: list[int]
    blocks: list[int]
    node: RadixNode
    inserted: int


class RadixCacheMachine(RuleBasedStateMachine):
    """Sequences simulated the way the scheduler drives the tree; KV 'content' is tracked per block."""

    NUM_BLOCKS = 24

    def __init__(self) -> None:
        super().__init__()
        self.allocator, self.cache = make_cache(self.NUM_BLOCKS)
        self.seqs: list[SimSequence] = []
        self.content: dict[int, tuple[int, ...]] = {}

    # -- helpers ---------------------------------------------------------------------------
    def tree_nodes(self) -> list[RadixNode]:
        return list(self.cache._nodes())

    def tree_paths(self, namespace: str) -> list[tuple[int, ...]]:
        paths = []
        for node in self.tree_nodes():
            if node.namespace != namespace:
                continue
            key: tuple[int, ...] = ()
            cur: RadixNode | None = node
            while cur is not None:
                key = cur.key + key
                cur = cur.parent
            paths.append(key)
        return paths

    def locked_blocks(self) -> set[int]:
        locked = set()
        for seq in self.seqs:
            node: RadixNode | None = seq.node
            while node is not None:
                locked.update(node.blocks)
                node = node.parent
        return locked

    def evict_checked(self, n: int) -> int:
        locked = self.locked_blocks()
        freed = self.cache.evict(n)
        tree_blocks = {b for node in self.tree_nodes() for b in node.blocks}
        assert locked <= tree_blocks, "a locked block was evicted"
        if freed < n:
            assert self.cache.num_evictable_blocks == 0
        return freed

    def release(self, seq: SimSequence) -> None:
        self.cache.unlock(seq.node)
        self.allocator.decref(seq.blocks)
        self.seqs.remove(seq)

    def insert(self, seq: SimSequence, upto: int) -> None:
        node = self.cache.insert(seq.namespace, seq.tokens[:upto], seq.blocks)
        self.cache.lock(node)
        self.cache.unlock(seq.node)
        seq.node, seq.inserted = node, upto

    # -- rules -----------------------------------------------------------------------------
    @rule(namespace=st.sampled_from(["a", "b"]), tokens=token_lists)
    def admit(self, namespace: str, tokens: list[int]) -> None:
        query = tokens[:-1]
        expected = 0
        for path in self.tree_paths(namespace):
            common = 0
            while common < min(len(path), len(query)) and path[common] == query[common]:
                common += 1
            expected = max(expected, common)
        match = self.cache.match_prefix(namespace, query)
        assert match.num_tokens == expected
        assert match.num_tokens == len(match.blocks) * BS + match.partial_tokens
        for i, block in enumerate(match.blocks):
            assert self.content[block] == tuple(tokens[i * BS : (i + 1) * BS])
        if match.partial_block is not None:
            start = len(match.blocks) * BS
            copied = self.content[match.partial_block][: match.partial_tokens]
            assert copied == tuple(tokens[start : start + match.partial_tokens])

        self.cache.lock(match.last_node)
        self.allocator.incref(match.blocks)
        need = -(-len(tokens) // BS) - len(match.blocks)
        if self.allocator.num_free < need:
            self.evict_checked(need - self.allocator.num_free)
        if self.allocator.num_free < need:
            self.cache.unlock(match.last_node)
            self.allocator.decref(match.blocks)
            return
        own = self.allocator.allocate(need)
        blocks = match.blocks + own
        for i, block in enumerate(own, start=len(match.blocks)):  # "prefill" (and copy-on-write)
            self.content[block] = tuple(tokens[i * BS : (i + 1) * BS])
        full = len(match.blocks) * BS
        self.seqs.append(SimSequence(namespace, tokens, blocks, match.last_node, full))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def insert_chunk(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        self.insert(seq, data.draw(st.integers(seq.inserted, len(seq.tokens))))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), cache_it=st.booleans())
    def finish(self, data: st.DataObject, cache_it: bool) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        if cache_it:
            self.insert(seq, len(seq.tokens))
        self.release(seq)

    @rule(n=st.integers(0, 8))
    def evict(self, n: int) -> None:
        self.evict_checked(n)

    @rule()
    def release_everything(self) -> None:
        for seq in list(self.seqs):
            self.release(seq)
        self.evict_checked(self.NUM_BLOCKS)
        assert self.allocator.num_free == self.NUM_BLOCKS
        assert self.cache.stats().tree_blocks == 0

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def blocks_are_owned_exactly_once_or_free(self) -> None:
        nodes = self.tree_nodes()
        tree_owned = Counter(b for node in nodes for b in node.blocks)
        assert all(count == 1 for count in tree_owned.values()), "a block is in the tree twice"
        seq_owned = Counter(b for seq in self.seqs for b in seq.blocks)
        for block in range(self.NUM_BLOCKS):
            assert self.allocator.refcount(block) == tree_owned[block] + seq_owned[block]
        free = sum(1 for block in range(self.NUM_BLOCKS) if self.allocator.refcount(block) == 0)
        assert self.allocator.num_free == free
        assert self.cache.stats().tree_blocks == len(tree_owned)

    @invariant()
    def nodes_are_page_aligned_and_hold_their_tokens(self) -> None:
        for node in self.tree_nodes():
            assert node.blocks and len(node.key) == len(node.blocks) * BS
            for i, block in enumerate(node.blocks):
                assert self.content[block] == node.key[i * BS : (i + 1) * BS]
            for first_page, child in node.children.items():
                assert child.parent is node and child.key[:BS] == first_page

    @invariant()
    def lock_counts_match_the_sequences(self) -> None:
        expected: Counter[int] = Counter()
        for seq in self.seqs:
            node: RadixNode | None = seq.node
            while node is not None and node.parent is not None:
                expected[id(node)] += 1
                node = node.parent
        nodes = self.tree_nodes()
        assert all(node.lock_ref == expected[id(node)] for node in nodes)
        unlocked = sum(len(node.blocks) for node in nodes if node.lock_ref == 0)
        assert self.cache.num_evictable_blocks == unlocked

    def teardown(self) -> None:
        self.release_everything()


RadixCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_radix_cache_state_machine = RadixCacheMachine.TestCase
