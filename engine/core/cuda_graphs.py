"""Decode steps replayed as CUDA graphs: one graph per batch size the scheduler uses.

A 135M-1B model's decode step is a few hundred small kernel launches; on a GPU the launches, not
the weights, bound it unless the step is captured once and replayed (what vLLM and SGLang do).
:class:`DecodeGraphs` captures ``model(ids, positions)`` for each size of :func:`capture_sizes`
over static input buffers, and :meth:`DecodeGraphs.run` copies a step's inputs into them and
replays the smallest graph that fits. Rows past the step's batch are padding: token 0 at position
0, written to and read from the runner's scratch KV block, which no sequence owns.

Only pure decode steps (one new token per attention row, e.g. no prefill chunk) replay; the
others run eagerly. The graph reads block tables and lengths from device tensors only, so only
decode backends that do (``graph_safe``: the Triton one) are captured.

The CUDA calls are behind :class:`GraphCapture`, the launch boundary tests replace on CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch

from engine.layers.context import Context, reset_context, set_context

Replay = Callable[[], None]


class GraphCapture(Protocol):
    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        """Record ``fn``'s launches; return what replays them and ``fn``'s (static) output."""
        ...


class CudaGraphCapture:
    """``torch.cuda.CUDAGraph`` capture; every graph shares one memory pool (vLLM's way)."""

    def __init__(self) -> None:
        self._pool: Any = None  # torch's pool handle, made at the first capture (it needs CUDA)

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        # An eager run first on a side stream, as torch asks before a capture (lazy init, compiles).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn()
        return graph.replay, out


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to ``max_num_seqs`` (and it): a step pads to the next size,
    so padding costs at most 7 rows past 8 while a batch of 64 takes 11 graphs."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted({*sizes, max_num_seqs})


class DecodeGraphs:
    def __init__(
        self,
        model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        sizes: list[int],
        max_blocks: int,
        scratch_block: int,
        block_size: int,
        device: torch.device,
        capture: GraphCapture,
    ) -> None:
        self.sizes = sorted(sizes)
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        biggest = self.sizes[-1]
        self.ids = torch.zeros(biggest, dtype=torch.long, device=device)
        self.positions = torch.zeros(biggest, dtype=torch.long, device=device)
        self.slots = torch.full((biggest,), self.scratch_slot, dtype=torch.long, device=device)
        self.tables = torch.full((biggest, max_blocks), -1, dtype=torch.int32, device=device)
        self.tables[:, 0] = scratch_block
        self.lens = torch.ones(biggest, dtype=torch.int32, device=device)
        self.query_lens = torch.ones(biggest, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[Replay, torch.Tensor]] = {}
        for size in reversed(self.sizes):  # the largest first: the shared pool fits the rest
            self._graphs[size] = capture(functools.partial(self._forward, model, size))

    def _context(self, size: int) -> Context:
        return Context(
            is_prefill=False,
            slot_mapping=self.slots[:size],
            query_lens=self.query_lens[:size],
            context_lens=self.lens[:size],
            block_tables=self.tables[:size],
            query_lens_host=[1] * size,
            context_lens_host=[1] * size,  # unread by a graph-safe backend
        )

    def _forward(
        self, model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], size: int
    ) -> torch.Tensor:
        set_context(self._context(size))
        try:
            return model(self.ids[:size], self.positions[:size])
        finally:
            reset_context()

    def size_for(self, context: Context, num_tokens: int) -> int | None:
        """The graph a step replays on: None for a step with a prefill chunk, a batch larger than the
        largest graph or block tables wider than the graphs' (it runs eagerly)."""
        tables = context.block_tables
        if context.is_prefill or context.num_seqs != num_tokens or tables is None:
            return None
        if tables.shape[1] > self.max_blocks:
            return None
        return next((s for s in self.sizes if s >= num_tokens), None)

    @torch.inference_mode()  # the static buffers are inference tensors (captured under warm-up's mode)
    def run(self, input_ids: list[int], positions: list[int], context: Context) -> torch.Tensor | None:
        """Hidden states [B, H] of a decode step by graph replay, or None where it must run eagerly."""
        batch = len(input_ids)
        size = self.size_for(context, batch)
        if size is None:
            return None
        assert context.block_tables is not None and context.slot_mapping is not None
        assert context.context_lens is not None
        self.ids[:batch].copy_(torch.tensor(input_ids, dtype=torch.long), non_blocking=True)
        self.positions[:batch].copy_(torch.tensor(positions, dtype=torch.long), non_blocking=True)
        self.slots[:batch].copy_(context.slot_mapping)
        self.lens[:batch].copy_(context.context_lens)
        width = context.block_tables.shape[1]
        self.tables[:batch, :width].copy_(context.block_tables)
        self.tables[:batch, width:] = -1
        if size > batch:  # rows a larger step left: back to padding
            self.ids[batch:size] = 0
            self.positions[batch:size] = 0
            self.slots[batch:size] = self.scratch_slot
            self.lens[batch:size] = 1
            self.tables[batch:size] = -1
            self.tables[batch:size, 0] = self.scratch_block
        replay, out = self._graphs[size]
        replay()
        return out[:batch].clone()  # the next replay overwrites the static output
