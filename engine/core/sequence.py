"""One generated choice: its tokens, how many of them are in the KV cache, and its blocks.

A request with ``n`` choices becomes ``n`` sequences that share a prompt. A
sequence is scheduled until ``num_computed_tokens == len(token_ids)``; the step
that computes its last token yields logits, and the sampled token is appended.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.structured.json_bounds import BoundedMatcher

from engine.core.outputs import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class DraftStats:
    """A sequence's record with speculative decoding, for backing off where it does not pay."""

    misses: int = 0
    """Consecutive verifications that accepted nothing."""
    cool_down: int = 0
    """Steps left without drafts."""
    num_tokens: int = 0
    """Drafts to propose next (0: the speculator's most); grows while drafts are all kept."""


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    """Resolved from ``sampling.max_tokens`` and the room left in the context."""
    index: int = 0
    """The choice index within its request."""
    generator: torch.Generator | None = None
    """Per-sequence RNG, so sampled tokens do not depend on the rest of the batch."""
    cache_namespace: str | None = None
    token_ids: list[int] = field(default_factory=list)
    """Prompt followed by the generated tokens."""
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache. Only the scheduler writes it."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (reported as usage ``cached_tokens``); scheduler-owned."""
    block_table: list[int] = field(default_factory=list)
    local_block_table: list[int] = field(default_factory=list)
    """The sliding-window layers' blocks (-1: freed, out of the window); see engine/cache/block_manager.py."""
    status: SequenceStatus = SequenceStatus.WAITING
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    prefix_handle: object | None = None
    """Opaque state a prefix cache attaches (e.g. the locked tree node); released on free."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: guesses for the tokens after the last one, checked by this step."""
    draft_stats: DraftStats = field(default_factory=DraftStats)
    matcher: BoundedMatcher | None = None
    """Structured output: where this sequence is in its grammar (masks its logits, eats its tokens)."""

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
