"""Triton paged-attention decode kernel and its plain-torch reference.

One program handles one sequence and one KV head: it loads the query heads that
share that KV head (GQA), walks the sequence's blocks through its block table and
keeps an online softmax, so nothing but the output is written back. Decode is
memory-bound, so the dot products are broadcast multiplies and sums rather than
``tl.dot`` (which needs 16-wide tiles and misbehaves for bf16 in the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.tuning import PAGED_DECODE


@triton.jit(do_not_specialize=["stride_table_seq"])  # block tables of any width: one compile
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    scale,
    window,
    stride_q_seq,
    stride_q_head,
    stride_kv_block,
    stride_kv_slot,
    stride_kv_head,
    stride_table_seq,
    stride_out_seq,
    stride_out_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_SIZE)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g

    q_offsets = seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    q = q * scale

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    # A sliding-window layer (window > 0) reads its last `window` keys only: the blocks before the
    # window's first are never loaded (they may be freed), and positions before it are masked.
    first_key = tl.maximum(context_len - window, 0) if window > 0 else 0
    num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
    for b in range(first_key // BLOCK_SIZE, num_blocks):
        block = tl.load(block_tables_ptr + seq * stride_table_seq + b).to(tl.int64)
        key_pos = b * BLOCK_SIZE + offs_n
        n_mask = (key_pos < context_len) & (key_pos >= first_key)
        kv_offsets = (
            block * stride_kv_block
            + offs_n[:, None] * stride_kv_slot
            + kv_head * stride_kv_head
            + offs_d[None, :]
        )
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    out = acc / l_i[:, None]
    out_offsets = seq * stride_out_seq + heads[:, None] * stride_out_head + offs_d[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Decode attention: q [B, H, D] over the paged cache [num_blocks, block_size, KVH, D] -> [B, H, D].

    ``block_tables`` [B, max_blocks] int32 (padded with -1) and ``context_lens`` [B]
    give each sequence's blocks and its number of cached tokens (its new token included); with a
    ``window``, each row attends to its last ``window`` keys only.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if block_size & (block_size - 1):
        raise ValueError("the Triton paged-attention kernel needs a power-of-two block size")
    if k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must share a layout with contiguous head_dim")
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    out = torch.empty_like(q)
    group = num_heads // num_kv_heads
    _paged_decode_kernel[(batch, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens.to(torch.int32).contiguous(),
        out,
        scale,
        window or 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(triton.next_power_of_2(group), 2),
        BLOCK_D=triton.next_power_of_2(head_dim),
        **PAGED_DECODE.default.kwargs(),
    )
    return out


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Plain-torch twin of :func:`paged_attention`, one sequence at a time, in float32."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for i in range(batch):
        length = int(context_lens[i])
        blocks = block_tables[i, : -(-length // block_size)].long()
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()
        first = max(length - window, 0) if window else 0
        keys, values = keys[first:], values[first:]
        keys = keys.repeat_interleave(group, dim=1)  # [L, H, D]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), keys) * scale
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), values).to(q.dtype)
    return out
