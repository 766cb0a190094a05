"""The per-step batch layout that attention reads, so model code stays sequence-agnostic.

The model runner packs every scheduled sequence's new tokens into one flat batch
of ``T`` tokens and calls :func:`set_context` before the forward pass. Attention
layers call :func:`get_context` to learn where each token's K/V goes in the paged
cache and which blocks each sequence attends over.

Sequence ``i`` owns the ``query_lens[i]`` query rows after those of sequences ``0 .. i - 1``; its new
tokens sit at the end of its ``context_lens[i]`` cached tokens, so query row ``j``
of sequence ``i`` may attend to keys ``0 .. context_lens[i] - query_lens[i] + j``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch


@dataclass
class Context:
    is_prefill: bool = False
    """True when any sequence in the step has more than one new token."""
    slot_mapping: torch.Tensor | None = None
    """[T] int64: flat cache slot (block * block_size + offset) for each new token."""
    query_lens: torch.Tensor | None = None
    """[B] int32: new tokens per sequence in this step."""
    context_lens: torch.Tensor | None = None
    """[B] int32: total KV length per sequence after this step (cached + new)."""
    block_tables: torch.Tensor | None = None
    """[B, max_blocks] int32, padded with -1."""
    query_lens_host: list[int] = field(default_factory=list)
    """``query_lens`` as Python ints, so the attention layer never syncs with the device."""
    context_lens_host: list[int] = field(default_factory=list)
    """``context_lens`` as Python ints."""
    cache: dict[Hashable, object] = field(default_factory=dict)
    """Per-step scratch shared by all layers (e.g. masks built once, used by every layer)."""
    rope_reach_host: list[int] = field(default_factory=list)
    """Per sequence, the furthest it reaches in the forward transformers would compute its tokens in:
    its whole prompt while prefilling, else its context (LongRoPE's short/long choice); empty: the
    context lengths."""
    local: Context | None = None
    """The sliding-window layers' view of the step: the same rows over their own pool's block tables
    and slots (engine/cache/block_manager.py); None: they share the main pool's."""

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)


_EMPTY = Context()
_context: Context = _EMPTY


def set_context(context: Context) -> None:
    global _context
    _context = context


def get_context() -> Context:
    return _context


def reset_context() -> None:
    global _context
    _context = _EMPTY


def make_context(
    *,
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]] | None,
    slot_mapping: list[int] | None,
    device: torch.device | str = "cpu",
    local_block_tables: list[list[int]] | None = None,
    local_slot_mapping: list[int] | None = None,
    rope_reach: list[int] | None = None,
) -> Context:
    """Build a :class:`Context` from host lists (shared by the model runner and tests); with
    ``local_block_tables`` and ``local_slot_mapping``, its ``local`` view for sliding-window layers."""
    device = torch.device(device)
    tables = None
    if block_tables is not None:
        width = max((len(t) for t in block_tables), default=0)
        padded = [t + [-1] * (width - len(t)) for t in block_tables]
        tables = torch.tensor(padded, dtype=torch.int32).reshape(len(padded), width).to(device)
    slots = None if slot_mapping is None else torch.tensor(slot_mapping, dtype=torch.int64, device=device)
    local = None
    if local_block_tables is not None:
        local = make_context(
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=local_block_tables,
            slot_mapping=local_slot_mapping,
            device=device,
        )
    return Context(
        local=local,
        is_prefill=any(n > 1 for n in query_lens),
        slot_mapping=slots,
        query_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=tables,
        query_lens_host=list(query_lens),
        context_lens_host=list(context_lens),
        rope_reach_host=list(rope_reach or ()),
    )
