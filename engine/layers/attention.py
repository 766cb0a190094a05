"""Attention over the paged KV cache: one layer that serves prefill, chunked prefill and decode.

Each forward first writes the step's new K/V into the cache at
``context.slot_mapping``, then every sequence attends over all of its cached
tokens (earlier chunks, prefix-cache hits and this step's tokens alike), with
the causal mask shifted by the tokens already cached. Grouped-query attention
folds the query heads that share a KV head into the query-length axis, so K/V
are never repeated.

Decode rows (one new token) of all sequences are batched into one call: on
CUDA the Triton paged-attention kernel, elsewhere one SDPA over the gathered
blocks. Sequences with several new tokens run one SDPA each.

Without a KV cache (``k_cache`` empty, e.g. a bare model in a parity test) each
sequence attends causally over its own new tokens only; without a context at all
the whole input is one sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.context import Context, get_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        # Assigned by the model runner: [num_blocks, block_size, num_kv_heads, head_dim].
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        num_tokens = q.shape[0]
        if ctx.num_seqs == 0:
            out = self._attend_uncached(q, k, v)
        elif self.k_cache.numel() == 0:
            out = torch.cat(
                [self._attend_uncached(q[a:b], k[a:b], v[a:b]) for a, b in _row_ranges(ctx.query_lens_host)]
            )
        else:
            _store_kv(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
            out = self._attend_paged(q, k, v, ctx)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    # -- paths -------------------------------------------------------------------------------

    def _attend_uncached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = q.shape[0]
        mask = _group_causal_mask(n, n, self.num_heads // self.num_kv_heads, q.device)
        return self._sdpa_one(q, k.transpose(0, 1), v.transpose(0, 1), mask)

    def _attend_paged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Context) -> torch.Tensor:
        if not ctx.is_prefill:
            return self._attend_decode(q, ctx, rows=None)
        out = torch.empty_like(q)
        decode_rows: list[int] = []
        decode_starts: list[int] = []
        for i, (start, end) in enumerate(_row_ranges(ctx.query_lens_host)):
            if end - start == 1:
                decode_rows.append(i)
                decode_starts.append(start)
                continue
            key_len = ctx.context_lens_host[i]
            if key_len == end - start and k.dtype == self.k_cache.dtype:
                # Nothing cached before this chunk: its own K/V are all it attends to (no gather).
                keys, values = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            else:
                keys, values = self._gather_one(ctx.block_tables[i], key_len)
            mask = self._prefill_mask(ctx, end - start, key_len, q.device)
            out[start:end] = self._sdpa_one(q[start:end], keys, values, mask)
        if decode_rows:
            index = torch.tensor(decode_starts, device=q.device)
            out[index] = self._attend_decode(q[index], ctx, rows=decode_rows)
        return out

    def _attend_decode(self, q: torch.Tensor, ctx: Context, rows: list[int] | None) -> torch.Tensor:
        """One new token per sequence; ``rows`` picks the sequences (None: all of them)."""
        if q.is_cuda:
            from engine.kernels.paged_attention import paged_attention

            tables, lens = ctx.block_tables, ctx.context_lens
            if rows is not None:
                index = torch.tensor(rows, device=q.device)
                tables, lens = tables[index], lens[index]
            return paged_attention(q, self.k_cache, self.v_cache, tables, lens, self.scale)
        return self._decode_torch(q, ctx, rows)

    def _decode_torch(self, q: torch.Tensor, ctx: Context, rows: list[int] | None) -> torch.Tensor:
        # The gather index and padding mask are the same for every layer; build them once per step.
        key = ("decode", None if rows is None else tuple(rows))
        layout = ctx.cache.get(key)
        if layout is None:
            layout = ctx.cache[key] = _decode_layout(ctx, rows, self.k_cache.shape[1], q.device)
        block_index, mask = layout  # type: ignore[misc]
        batch, kv_heads, dim = q.shape[0], self.num_kv_heads, self.head_dim
        # index_select over the flat block list: the copy k_cache[block_index] makes, at 2/3 of its cost.
        keys = self.k_cache.index_select(0, block_index).view(batch, -1, kv_heads, dim).transpose(1, 2)
        values = self.v_cache.index_select(0, block_index).view(batch, -1, kv_heads, dim).transpose(1, 2)
        group = self.num_heads // kv_heads
        queries = q.reshape(batch, kv_heads, group, dim)
        if queries.dtype != keys.dtype:
            queries = queries.to(keys.dtype)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale)
        out = out.reshape(batch, self.num_heads, dim)
        return out if out.dtype == q.dtype else out.to(q.dtype)

    def _prefill_mask(
        self, ctx: Context, num_queries: int, num_keys: int, device: torch.device
    ) -> torch.Tensor:
        """The folded causal mask of a sequence's chunk, built once per step for all layers."""
        group = self.num_heads // self.num_kv_heads
        key = ("causal", num_queries, num_keys, group)
        mask = ctx.cache.get(key)
        if mask is None:
            mask = ctx.cache[key] = _group_causal_mask(num_queries, num_keys, group, device)
        return mask  # type: ignore[return-value]

    def _gather_one(self, block_table: torch.Tensor, key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first ``key_len`` cached K/V as [KVH, key_len, D]."""
        block_size = self.k_cache.shape[1]
        blocks = block_table[: -(-key_len // block_size)].long()
        shape = (-1, self.num_kv_heads, self.head_dim)
        keys = self.k_cache[blocks].reshape(shape)[:key_len].transpose(0, 1)
        values = self.v_cache[blocks].reshape(shape)[:key_len].transpose(0, 1)
        return keys, values

    def _sdpa_one(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q [n, H, D] against keys/values [KVH, L, D] with a folded mask [G * n, L] -> [n, H, D]."""
        n, kv_heads, dim = q.shape[0], self.num_kv_heads, self.head_dim
        group = self.num_heads // kv_heads
        # [n, KVH, G, D] -> [KVH, G * n, D]: the heads sharing a KV head become extra query rows.
        queries = q.reshape(n, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * n, dim)
        out = F.scaled_dot_product_attention(
            queries.to(keys.dtype), keys, values, attn_mask=mask, scale=self.scale
        )
        out = out.reshape(kv_heads, group, n, dim).permute(2, 0, 1, 3)
        return out.reshape(n, self.num_heads, dim).to(q.dtype)


def _store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor | None
) -> None:
    if slots is None:
        raise RuntimeError("attention has a KV cache but the context has no slot_mapping")
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    if k.dtype != k_cache.dtype:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache.view(-1, kv_heads, dim).index_copy_(0, slots, k)
    v_cache.view(-1, kv_heads, dim).index_copy_(0, slots, v)


def _row_ranges(query_lens: list[int]) -> list[tuple[int, int]]:
    ranges, start = [], 0
    for n in query_lens:
        ranges.append((start, start + n))
        start += n
    return ranges


def _group_causal_mask(num_queries: int, num_keys: int, group: int, device: torch.device) -> torch.Tensor:
    """[G * n, L] bool: query j sits at position L - n + j and sees keys up to it; repeated for the
    ``group`` query heads folded into the query axis."""
    offset = num_keys - num_queries
    query_pos = torch.arange(num_queries, device=device)[:, None] + offset
    mask = torch.arange(num_keys, device=device)[None, :] <= query_pos
    return mask.expand(group, num_queries, num_keys).reshape(group * num_queries, num_keys)


def _decode_layout(
    ctx: Context, rows: list[int] | None, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The flat block list to gather ([B * nb] int64) and the padding mask ([B, 1, 1, L] bool or None)."""
    lens = ctx.context_lens_host if rows is None else [ctx.context_lens_host[i] for i in rows]
    tables = ctx.block_tables if rows is None else ctx.block_tables[torch.tensor(rows, device=device)]
    num_blocks = -(-max(lens) // block_size)
    block_index = tables[:, :num_blocks].clamp(min=0).long().reshape(-1)
    if all(n == num_blocks * block_size for n in lens):
        return block_index, None
    key_pos = torch.arange(num_blocks * block_size, device=device)
    lens_t = torch.tensor(lens, device=device)
    mask = (key_pos[None, :] < lens_t[:, None])[:, None, None, :]
    return block_index, mask
