"""Block tables on top of the reference-counted allocator: growth, sharing, freeing."""

from __future__ import annotations

import pytest

from engine.cache.block_allocator import BlockAllocator, NoFreeBlocksError
from engine.cache.block_manager import BlockManager
from engine.cache.prefix_cache import PrefixCachingBlockManager
from engine.core.outputs import SamplingParams
from engine.core.sequence import Sequence


def make_seq(num_prompt_tokens: int) -> Sequence:
    return Sequence("r", list(range(num_prompt_tokens)), SamplingParams(), max_tokens=8)


def test_allocate_grows_lazily_by_whole_blocks() -> None:
    manager = BlockManager(BlockAllocator(10), block_size=4)
    seq = make_seq(6)
    assert manager.num_missing_blocks(seq, 6) == 2
    manager.allocate(seq, 6)
    seq.num_computed_tokens = 6
    assert len(seq.block_table) == 2 and manager.num_free_blocks == 8
    manager.allocate(seq, 2)  # tokens 6, 7 still fit in block 2
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 8
    manager.allocate(seq, 1)
    assert len(seq.block_table) == 3 and manager.num_free_blocks == 7


def test_allocation_failure_takes_nothing() -> None:
    manager = BlockManager(BlockAllocator(3), block_size=4)
    seq = make_seq(20)
    assert not manager.can_allocate(seq, 20)
    with pytest.raises(NoFreeBlocksError):
        manager.allocate(seq, 20)
    assert seq.block_table == [] and manager.num_free_blocks == 3


def test_shared_blocks_return_only_after_the_last_holder_frees() -> None:
    allocator = BlockAllocator(8)
    manager = BlockManager(allocator, block_size=4)
    parent, child = make_seq(10), make_seq(10)
    manager.allocate(parent, 10)
    manager.share(child, parent.block_table[:2])
    assert child.block_table == parent.block_table[:2]
    child.num_computed_tokens = 8  # the scheduler's part: the shared blocks hold 8 tokens
    assert [allocator.refcount(b) for b in parent.block_table] == [2, 2, 1]
    manager.allocate(child, 2)  # its own third block
    assert manager.num_free_blocks == 4
    manager.free(parent)
    assert manager.num_free_blocks == 5 and parent.block_table == []
    manager.free(child)
    assert manager.num_free_blocks == 8 and child.block_table == []


def test_blocks_used_before_are_handed_out_before_unused_ones() -> None:
    # The pool's pages cost memory once written: traffic that never holds more than 3 blocks at once
    # must keep using the same 3, not walk the whole pool (a queue handed every block out in turn).
    allocator = BlockAllocator(64)
    used: set[int] = set()
    for _ in range(20):
        blocks = allocator.allocate(3)
        used.update(blocks)
        allocator.decref(reversed(blocks))
    assert used == {0, 1, 2}
    first = allocator.allocate(2)
    allocator.decref([first[0]])
    assert allocator.allocate(1) == [first[0]]  # the block freed last comes back first


def test_the_prefix_cache_reuses_its_blocks_before_growing_the_written_pool() -> None:
    # Distinct prompts, one after another: the cache keeps each finished prompt's blocks. Past
    # `resident_blocks` written blocks, a new prompt takes blocks the cache evicts (least recently
    # used) instead of never-written ones, so the pool's resident part stops growing; a sequence
    # that needs more than that still gets the whole pool.
    allocator = BlockAllocator(32)
    manager = PrefixCachingBlockManager(allocator, block_size=4, model_name="m", resident_blocks=8)
    for i in range(10):
        seq = Sequence(f"r{i}", [1000 * i + t for t in range(8)], SamplingParams(), max_tokens=8)
        manager.allocate(seq, 8)
        seq.num_computed_tokens = 8
        manager.free(seq)  # its 2 blocks stay in the cache
    assert allocator.num_written == 8
    assert manager.num_reclaimable_blocks() == 8  # the last 4 prompts, still cached
    newest = Sequence("again", [9000 + t for t in range(8)] + [7], SamplingParams(), max_tokens=8)
    assert manager.cached_prefix_len(newest) == 8
    long = make_seq(32 * 4)
    manager.allocate(long, 32 * 4)
    assert allocator.num_written == 32 and allocator.num_free == 0


def test_without_a_cap_reached_the_prefix_cache_keeps_what_it_holds() -> None:
    allocator = BlockAllocator(32)
    manager = PrefixCachingBlockManager(allocator, block_size=4, model_name="m")  # 16 blocks
    for i in range(8):
        seq = Sequence(f"r{i}", [1000 * i + t for t in range(8)], SamplingParams(), max_tokens=8)
        manager.allocate(seq, 8)
        seq.num_computed_tokens = 8
        manager.free(seq)
    assert allocator.num_written == 16 and manager.num_reclaimable_blocks() == 16


def test_free_blocks_written_since_their_pages_went_back_are_taken_once() -> None:
    allocator = BlockAllocator(8)
    first = allocator.allocate(3)
    assert allocator.take_free_dirty() == []  # all held
    allocator.decref(first[1:])
    assert sorted(allocator.take_free_dirty()) == first[1:]
    assert allocator.take_free_dirty() == []  # given back already: clean until written again
    again = allocator.allocate(1)  # the block freed last
    allocator.decref(again)
    assert allocator.take_free_dirty() == again
