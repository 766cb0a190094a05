"""Paged attention: the Triton decode kernel against its torch reference (Triton's CPU
interpreter here, CUDA where there is one), and the Attention layer against plain causal
attention over whole sequences, for prefill, chunked prefill and decode in one batch."""

from __future__ import annotations

import math

import pytest
import torch

from engine.kernels.paged_attention import paged_attention, paged_attention_ref
from engine.layers.attention import Attention
from engine.layers.context import make_context, reset_context, set_context

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_paged_cache(
    context_lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V pool with scattered (shuffled) blocks per sequence; tables padded with -1."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(context_lens), max(needed)), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor(order[used : used + n], dtype=torch.int32)
        used += n
    return k_cache, v_cache, tables


@pytest.mark.parametrize(
    ("context_lens", "block_size", "heads", "kv_heads", "head_dim", "dtype"),
    [
        ([5, 1, 13], 4, 6, 2, 12, torch.float32),  # GQA group 3 (not a power of two), ragged head_dim
        ([17, 3], 8, 4, 4, 16, torch.float32),  # MHA
        ([9, 30, 2, 4], 4, 8, 2, 8, torch.float16),
    ],
)
def test_triton_kernel_matches_reference(
    context_lens: list[int], block_size: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    k_cache, v_cache, tables = random_paged_cache(context_lens, block_size, kv_heads, head_dim, dtype, seed=1)
    q = torch.randn(len(context_lens), heads, head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = 1 / math.sqrt(head_dim)
    args = [t.to(DEVICE) for t in (q, k_cache, v_cache, tables, lens)]
    out = paged_attention(*args, scale).cpu()
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_triton_kernel_takes_a_sliding_window() -> None:
    """A window: each row attends to its last ``window`` keys; the blocks before the window's first are
    never read (here: freed, their table entries -1, as a sliding-window layer's pool has them)."""
    context_lens, block_size, window = [5, 1, 13, 30], 4, 6
    k_cache, v_cache, tables = random_paged_cache(context_lens, block_size, 2, 8, torch.float32, seed=3)
    q = torch.randn(len(context_lens), 4, 8, generator=torch.Generator().manual_seed(4))
    lens = torch.tensor(context_lens, dtype=torch.int32)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, lens, 0.3, window)
    for row, length in enumerate(context_lens):  # the reference itself: plain attention over the window
        blocks = tables[row, : -(-length // block_size)].long()
        keys = k_cache[blocks].reshape(-1, 2, 8)[max(0, length - window) : length].repeat_interleave(2, 1)
        values = v_cache[blocks].reshape(-1, 2, 8)[max(0, length - window) : length].repeat_interleave(2, 1)
        weights = (torch.einsum("hd,lhd->hl", q[row], keys) * 0.3).softmax(-1)
        torch.testing.assert_close(ref[row], torch.einsum("hl,lhd->hd", weights, values))
    for row, length in enumerate(context_lens):
        tables[row, : max(0, length - window) // block_size] = -1
    args = [t.to(DEVICE) for t in (q, k_cache, v_cache, tables, lens)]
    torch.testing.assert_close(paged_attention(*args, 0.3, window).cpu(), ref, atol=1e-5, rtol=1e-5)


def full_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D] are the last n positions of keys/values [L, KVH, D] -> [n, H * D]."""
    n, heads, dim = q.shape
    length, kv_heads = k.shape[0], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    visible = torch.arange(length)[None, :] <= torch.arange(n)[:, None] + (length - n)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hnl,lhd->nhd", probs, v).reshape(n, heads * dim)


class PagedRun:
    """Feeds whole sequences through one Attention layer in chunks, as the model runner would."""

    def __init__(self, lengths: list[int], heads: int = 6, kv_heads: int = 2, dim: int = 8, bs: int = 4):
        gen = torch.Generator().manual_seed(0)
        self.q = [torch.randn(n, heads, dim, generator=gen) for n in lengths]
        self.k = [torch.randn(n, kv_heads, dim, generator=gen) for n in lengths]
        self.v = [torch.randn(n, kv_heads, dim, generator=gen) for n in lengths]
        self.scale = 1 / math.sqrt(dim)
        self.bs = bs
        self.layer = Attention(heads, dim, kv_heads, self.scale)
        num_blocks = sum(-(-n // bs) for n in lengths) + 2
        self.layer.k_cache = torch.zeros(num_blocks, bs, kv_heads, dim)
        self.layer.v_cache = torch.zeros(num_blocks, bs, kv_heads, dim)
        order = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables, used = [], 0
        for n in lengths:
            self.tables.append(order[used : used + -(-n // bs)])
            used += -(-n // bs)

    def step(self, spans: dict[int, tuple[int, int]]) -> None:
        """Compute tokens [start, end) of each sequence in ``spans`` in one batch; check the output."""
        seqs = list(spans)
        slots = [self.tables[i][p // self.bs] * self.bs + p % self.bs for i in seqs for p in range(*spans[i])]
        ctx = make_context(
            query_lens=[spans[i][1] - spans[i][0] for i in seqs],
            context_lens=[spans[i][1] for i in seqs],
            block_tables=[self.tables[i] for i in seqs],
            slot_mapping=slots,
        )
        set_context(ctx)
        try:
            out = self.layer(
                torch.cat([self.q[i][slice(*spans[i])] for i in seqs]),
                torch.cat([self.k[i][slice(*spans[i])] for i in seqs]),
                torch.cat([self.v[i][slice(*spans[i])] for i in seqs]),
            )
        finally:
            reset_context()
        expected = torch.cat(
            [
                full_causal_attention(
                    self.q[i][slice(*spans[i])],
                    self.k[i][: spans[i][1]],
                    self.v[i][: spans[i][1]],
                    self.scale,
                )
                for i in seqs
            ]
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_attention_mixed_steps() -> None:
    run = PagedRun([7, 2, 5, 9, 3])
    run.step({0: (0, 4), 1: (0, 1), 2: (0, 5), 3: (0, 6)})  # whole and partial prompts
    run.step({0: (4, 7), 1: (1, 2), 3: (6, 8), 4: (0, 3)})  # a chunk, a decode, a new prompt
    run.step({3: (8, 9)})  # decode only: the batched decode path


def test_attention_decode_only_step_with_ragged_lengths() -> None:
    """A pure-decode step takes the batched path: one gather, a padding mask for ragged lengths."""
    run = PagedRun([6, 11, 1, 4])
    run.step({0: (0, 5), 1: (0, 10), 3: (0, 3)})
    run.step({0: (5, 6), 1: (10, 11), 2: (0, 1), 3: (3, 4)})


def test_attention_without_cache_is_causal_per_sequence() -> None:
    run = PagedRun([5, 3])
    run.layer.k_cache = torch.empty(0)
    run.layer.v_cache = torch.empty(0)
    run.step({0: (0, 5), 1: (0, 3)})
    out = run.layer(run.q[0], run.k[0], run.v[0])  # no context at all: one sequence
    torch.testing.assert_close(out, full_causal_attention(run.q[0], run.k[0], run.v[0], run.scale))
