"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step has a token budget (``max_num_batched_tokens``) and a batch limit
(``max_num_seqs``). Running sequences go first, oldest first: a decode needs one
token, a prompt still being prefilled gets a chunk of what is left of the
budget (keeping one token for each running sequence behind it, so long prompts
never stall decodes). Waiting sequences are then admitted in arrival order while
the budget, the batch limit and the KV pool allow.

When the pool runs out, the most recently admitted running sequence is
preempted: its blocks are freed and it goes back to the front of the waiting
queue, to be recomputed later (its generated tokens are kept). Nothing fails
for lack of memory; it waits.

The scheduler is the only writer of a sequence's progress (``num_computed_tokens``,
``num_cached_tokens``, its tokens): the block manager reports what it reused and
:meth:`Scheduler.postprocess` applies what a step computed and sampled.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.cache.block_manager import BlockManager
from engine.core.sampler import SampledToken
from engine.core.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    """Tokens each sequence computes this step, starting at its ``num_computed_tokens``."""
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) whole-block KV copies to run before the forward (prefix-cache copy-on-write)."""
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        max_cache_aware_wait_s: float = 5.0,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Keep a few blocks spare when admitting, so running sequences can grow without preempting.
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)
        self.max_cache_aware_wait_s = max_cache_aware_wait_s
        self.max_cache_aware_queue = 256
        """Longer queues are taken in arrival order (ordering costs a tree lookup per sequence)."""

    # -- queue changes -------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_first(self, seq: Sequence) -> None:
        """Queue ``seq`` ahead of everything waiting (forked choices of a running request)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def add_forked(self, child: Sequence, parent: Sequence) -> None:
        """Queue ``child``, a further choice of ``parent``'s request, sharing its computed prompt blocks.

        The child still computes at least one prompt token itself, so its first step
        yields logits; it reports the parent's cached tokens.
        """
        bs = self.block_manager.block_size
        shared_blocks = (parent.num_prompt_tokens - 1) // bs
        child.num_cached_tokens = parent.num_cached_tokens
        # With sliding-window layers the parent's early local pages may be gone: the child recomputes.
        if shared_blocks and self.block_manager.window is None:
            self.block_manager.share(child, parent.block_table[:shared_blocks])
            child.num_computed_tokens = shared_blocks * bs
        self.add_first(child)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks now."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self._free(seq)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- scheduling ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if out.num_preempted == 0:
            self._schedule_waiting(out, budget)
        return out

    def postprocess(
        self, batch: SchedulerOutput, sampled: list[list[SampledToken]]
    ) -> list[tuple[Sequence, SampledToken]]:
        """Apply a step: advance what each sequence computed, append its sampled tokens (one, or
        with speculative decoding the accepted drafts and one more), forget rejected drafts.

        Returns each (sequence, token) in order, for the engine to emit.
        """
        got: list[tuple[Sequence, SampledToken]] = []
        for seq, num_new, tokens in zip(batch.seqs, batch.num_new_tokens, sampled, strict=True):
            drafts = len(seq.draft_token_ids)
            rejected = drafts - (len(tokens) - 1) if drafts else 0
            seq.num_computed_tokens += num_new - rejected  # rejected drafts' KV is not kept
            for token in tokens:
                seq.append_token(token.token_id)
                got.append((seq, token))
            if drafts:
                seq.draft_token_ids = []
                self.block_manager.trim(seq)
        return got

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            behind = len(self.running) - i - 1
            num_new = min(seq.num_uncomputed_tokens + len(seq.draft_token_ids), budget - behind)
            if num_new <= 0:
                seq.draft_token_ids = []
                i += 1
                continue
            if seq.draft_token_ids:  # drafts take what is left of the budget and the pool, never more
                if not self.block_manager.can_allocate(seq, num_new):
                    num_new = seq.num_uncomputed_tokens
                del seq.draft_token_ids[max(0, num_new - seq.num_uncomputed_tokens) :]
            while not self.block_manager.can_allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                self.block_manager.allocate(seq, num_new)
                out.seqs.append(seq)
                out.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        for seq in self._admission_order(time.monotonic()):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            fresh = seq.num_computed_tokens == 0 and not seq.block_table
            if fresh and self._prefix_in_flight(seq):
                continue  # a running prefill is computing this prefix: wait a step or two and reuse it
            copies = self._reuse_cached_prefix(seq) if fresh else []
            num_new = seq.num_uncomputed_tokens
            if num_new > budget and not self.enable_chunked_prefill:
                # Whole prompts only; one larger than the budget runs alone so it cannot starve.
                if out.seqs:
                    self._undo_prefix(seq, fresh)
                    break
            else:
                num_new = min(num_new, budget)
            spare = self.watermark_blocks if self.running else 0
            if not self.block_manager.can_allocate(seq, num_new, reserve=spare):
                self._undo_prefix(seq, fresh)
                break
            self.block_manager.allocate(seq, num_new)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            out.block_copies.extend(copies)
            budget -= num_new

    def _admission_order(self, now: float) -> list[Sequence]:
        """Waiting sequences in the order to try them.

        Without a prefix cache: the queue order (arrival, preempted and forked ones first).
        With one: sequences already started (preempted, forked) and those waiting longer
        than ``max_cache_aware_wait_s`` keep queue order and go first, so no cold request
        starves; the rest follow by longest cached prefix (least prefill), oldest first
        among equals.
        """
        queue = list(self.waiting)
        if not self.block_manager.caches_prefixes or not 1 < len(queue) <= self.max_cache_aware_queue:
            return queue

        def keeps_its_place(seq: Sequence) -> bool:
            started = bool(seq.block_table) or seq.num_preemptions > 0
            return started or now - seq.arrival_time >= self.max_cache_aware_wait_s

        first = [seq for seq in queue if keeps_its_place(seq)]
        rest = [seq for seq in queue if not keeps_its_place(seq)]
        rest.sort(key=lambda seq: -self.block_manager.cached_prefix_len(seq))  # stable: oldest first
        return first + rest

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """Whether a running prompt still being prefilled shares a block more with ``seq`` than the cache.

        Admitting ``seq`` now would compute that block twice; once the other prefill
        completes, the block is in the cache. This waits at most for that prefill to
        finish, so it needs no age bound.
        """
        if not self.block_manager.caches_prefixes:
            return False
        prompt = seq.prompt_token_ids
        cached = None
        for other in self.running:
            prefilling = other.num_computed_tokens < other.num_prompt_tokens
            if not prefilling or other.cache_namespace != seq.cache_namespace:
                continue
            if cached is None:
                cached = self.block_manager.cached_prefix_len(seq)
            bs = self.block_manager.block_size
            n = (cached // bs + 1) * bs  # the end of the next block the cache lacks
            if n < len(prompt) and prompt[:n] == other.prompt_token_ids[:n]:
                return True
        return False

    def _reuse_cached_prefix(self, seq: Sequence) -> list[tuple[int, int]]:
        """Take what the prefix cache holds for ``seq``; returns the block copies to run first."""
        reused = self.block_manager.reuse_cached_prefix(seq)
        seq.num_computed_tokens = reused.num_tokens
        if seq.num_preemptions == 0 and self.block_manager.caches_prefixes:
            seq.num_cached_tokens = min(reused.num_tokens, seq.num_prompt_tokens)  # the first admission's
        return reused.block_copies

    def _undo_prefix(self, seq: Sequence, fresh: bool) -> None:
        """Give back cached blocks just taken for a sequence that is not admitted after all."""
        if fresh and seq.block_table:
            self._free(seq)
            seq.num_cached_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.draft_token_ids = []
        self._free(seq)
        seq.num_preemptions += 1
        self.add_first(seq)

    def _free(self, seq: Sequence) -> None:
        """Drop the sequence's blocks; with its KV gone, it recomputes from the start."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
