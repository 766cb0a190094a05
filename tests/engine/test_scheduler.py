"""The scheduler on its own (no model): budgets, chunked prefill, admission and preemption."""

from __future__ import annotations

from engine.cache.block_allocator import BlockAllocator
from engine.cache.block_manager import BlockManager
from engine.core.outputs import SamplingParams
from engine.core.sampler import SampledToken
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.sequence import Sequence, SequenceStatus


def make_scheduler(
    num_blocks: int = 64, *, seqs: int = 8, tokens: int = 32, chunked: bool = True
) -> Scheduler:
    manager = BlockManager(BlockAllocator(num_blocks), block_size=4)
    return Scheduler(
        manager, max_num_seqs=seqs, max_num_batched_tokens=tokens, enable_chunked_prefill=chunked
    )


def make_seq(name: str, num_prompt_tokens: int) -> Sequence:
    return Sequence(name, list(range(num_prompt_tokens)), SamplingParams(), max_tokens=100)


def run_step(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """What the model runner returns for a step: a token for each sequence whose prompt is all computed."""
    sampled = [
        [SampledToken(1)] if seq.num_computed_tokens + n == seq.num_tokens else []
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True)
    ]
    scheduler.postprocess(out, sampled)


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request_id, n) for s, n in zip(out.seqs, out.num_new_tokens, strict=True)]


def test_long_prompt_is_chunked_and_decodes_keep_running() -> None:
    scheduler = make_scheduler(tokens=16)
    short = make_seq("short", 3)
    scheduler.add(short)
    run_step(scheduler, scheduler.schedule())  # short prefilled, now decoding
    long = make_seq("long", 40)
    scheduler.add(long)
    steps = []
    while long.num_computed_tokens < 40:
        out = scheduler.schedule()
        steps.append(plan(out))
        assert out.num_tokens <= 16
        run_step(scheduler, out)
    assert steps[0] == [("short", 1), ("long", 15)]
    assert all(("short", 1) in s for s in steps)  # never stalled by the long prefill
    assert sum(n for s in steps for r, n in s if r == "long") == 40


def test_without_chunking_a_prompt_waits_for_a_step_with_room() -> None:
    scheduler = make_scheduler(tokens=16, chunked=False)
    scheduler.add(make_seq("a", 10))
    scheduler.add(make_seq("b", 10))
    out = scheduler.schedule()
    assert plan(out) == [("a", 10)]  # b would overflow the budget, it is not split
    run_step(scheduler, out)
    assert plan(scheduler.schedule()) == [("a", 1), ("b", 10)]


def test_oversized_prompt_runs_alone_without_chunking() -> None:
    scheduler = make_scheduler(tokens=8, chunked=False)
    scheduler.add(make_seq("big", 20))
    assert plan(scheduler.schedule()) == [("big", 20)]


def test_batch_size_limit() -> None:
    scheduler = make_scheduler(seqs=2)
    for name in "abc":
        scheduler.add(make_seq(name, 2))
    out = scheduler.schedule()
    assert [s.request_id for s in out.seqs] == ["a", "b"]
    assert scheduler.num_waiting == 1


def test_requests_that_do_not_fit_wait_then_run() -> None:
    scheduler = make_scheduler(num_blocks=4)  # 16 tokens of KV in all
    a, b = make_seq("a", 12), make_seq("b", 12)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert plan(out) == [("a", 12)] and b.status is SequenceStatus.WAITING
    run_step(scheduler, out)
    scheduler.finish(a)
    assert plan(scheduler.schedule()) == [("b", 12)]


def test_growth_past_the_pool_preempts_the_newest_by_recompute() -> None:
    scheduler = make_scheduler(num_blocks=5)
    old, new = make_seq("old", 7), make_seq("new", 7)
    scheduler.add(old)
    run_step(scheduler, scheduler.schedule())
    scheduler.add(new)
    run_step(scheduler, scheduler.schedule())  # both hold 2 blocks, one is left
    for _ in range(2):  # both reach token 9: old takes the last block, new has none
        out = scheduler.schedule()
        run_step(scheduler, out)
    assert new.status is SequenceStatus.WAITING and new.num_preemptions == 1
    assert new.block_table == [] and new.num_computed_tokens == 0
    assert new.num_tokens == 9  # its generated tokens are kept and recomputed later
    assert scheduler.waiting[0] is new
    scheduler.finish(old)
    assert plan(scheduler.schedule()) == [("new", 9)]


def test_finish_frees_blocks_from_either_queue() -> None:
    scheduler = make_scheduler(num_blocks=8)
    running, waiting = make_seq("a", 8), make_seq("b", 100)
    scheduler.add(running)
    scheduler.add(waiting)
    scheduler.schedule()
    scheduler.finish(running)
    scheduler.finish(waiting)
    assert scheduler.block_manager.num_free_blocks == 8
    assert scheduler.num_running == scheduler.num_waiting == 0


def test_postprocess_advances_computed_tokens_and_appends_sampled_ones() -> None:
    scheduler = make_scheduler(tokens=6)
    seq = make_seq("a", 10)
    scheduler.add(seq)
    out = scheduler.schedule()
    assert scheduler.postprocess(out, [[]]) == []  # a prefill chunk: nothing sampled yet
    assert (seq.num_computed_tokens, seq.num_tokens) == (6, 10)
    out = scheduler.schedule()
    token = SampledToken(7)
    assert scheduler.postprocess(out, [[token]]) == [(seq, token)]
    assert (seq.num_computed_tokens, seq.output_token_ids) == (10, [7])


def test_forked_choices_share_the_parents_full_prompt_blocks() -> None:
    scheduler = make_scheduler()
    parent = make_seq("n", 10)  # blocks of 4: the child shares the first two, computes from token 8
    scheduler.add(parent)
    run_step(scheduler, scheduler.schedule())
    child = Sequence("n", parent.prompt_token_ids, SamplingParams(), max_tokens=100, index=1)
    scheduler.add_forked(child, parent)
    assert child.block_table == parent.block_table[:2] and child.num_computed_tokens == 8
    assert scheduler.waiting[0] is child
    assert plan(scheduler.schedule()) == [("n", 1), ("n", 2)]
