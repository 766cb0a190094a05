"""Attention over the paged KV cache: one layer that serves prefill, chunked prefill and decode.

Each forward first writes the step's new K/V into the cache at
``context.slot_mapping``, then every sequence attends over all of its cached
tokens (earlier chunks, prefix-cache hits and this step's tokens alike), with
the causal mask shifted by the tokens already cached. Grouped-query attention
folds the query heads that share a KV head into the query-length axis, so K/V
are never repeated.

Decode rows (one new token) of all sequences are batched into one call to the
layer's decode backend, chosen once at load (``engine/layers/attention_backends.py``:
Triton on CUDA, the C kernel on the float32 CPU fast path, else SDPA over the
gathered blocks). Sequences with several new tokens run one SDPA each.

Without a KV cache (``k_cache`` empty, e.g. a bare model in a parity test) each
sequence attends causally over its own new tokens only; without a context at all
the whole input is one sequence.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention_backends import DecodeBackend, TorchDecode
from engine.layers.context import Context, get_context

QUERY_TILE = 128
"""Query positions per tile of the float32 chunk attention of bfloat16 models (``_attend_tiles``)."""


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        backend: DecodeBackend | None = None,
    ) -> None:
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
        self.backend: DecodeBackend = backend or TorchDecode()
        """How decode rows read the cache; the loader sets it once, as it builds the model
        (``engine/loader/build_plan.py``)."""
        self.window: int | None = None
        """A sliding-window layer's window: each token attends to the last ``window`` positions, itself
        included (transformers' and llama.cpp's masks); None: to every earlier position."""

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for a model computing in ``model_dtype`` (the backend's to say: float16
        on the C kernel, as llama.cpp keeps it)."""
        return self.backend.cache_dtype(model_dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        if self.window is not None and ctx.local is not None:
            ctx = ctx.local  # a sliding-window layer's own pool (its early pages may be freed)
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
        return self._attend_chunk(q, k.transpose(0, 1), v.transpose(0, 1), {})

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
                # Through the cache, so that a chunk attends to the same (rounded) keys whether or not
                # an earlier chunk or the prefix cache computed them.
                assert ctx.block_tables is not None  # a paged step has them
                keys, values = self._gather_one(
                    ctx.block_tables[i], key_len, self._first_key(key_len, end - start)
                )
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            out[start:end] = self._attend_chunk(q[start:end], keys, values, ctx.cache)
        if decode_rows:
            index = torch.tensor(decode_starts, device=q.device)
            out[index] = self._attend_decode(q[index], ctx, rows=decode_rows)
        return out

    def _attend_decode(self, q: torch.Tensor, ctx: Context, rows: list[int] | None) -> torch.Tensor:
        """One new token per sequence; ``rows`` picks the sequences (None: all of them)."""
        return self.backend(q, self.k_cache, self.v_cache, ctx, rows, self.scale, self.window)

    def _attend_chunk(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step_cache: dict[Hashable, object]
    ) -> torch.Tensor:
        """Causal attention of q [n, H, D], the last n of L positions, over keys/values [KVH, L, D].
        Masks are built once per step (``step_cache``) and shared by every layer."""
        if q.dtype == torch.bfloat16:
            return self._attend_tiles(q, keys, values, step_cache)
        n, num_keys, group = q.shape[0], keys.shape[1], self.num_heads // self.num_kv_heads
        key = ("causal", n, num_keys, group, self.window)
        mask = step_cache.get(key)
        if mask is None:
            mask = step_cache[key] = _group_causal_mask(n, num_keys, group, q.device, window=self.window)
        return self._sdpa_one(q, keys, values, mask)  # type: ignore[arg-type]

    def _attend_tiles(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step_cache: dict[Hashable, object]
    ) -> torch.Tensor:
        """``_attend_chunk`` for bfloat16 (the CPU fast path): float32 arithmetic, by tiles of positions.

        Not SDPA: its bf16 kernel splits the work by the query and key counts, so a token attended over
        a cached prefix came out a rounding different from the same token in a whole prompt, and greedy
        outputs changed with the prefix cache on (2 of 8 prompts). Here tiles start at multiples of
        ``QUERY_TILE`` positions and each attends to the keys up to its tile's end (zero-padded past
        the last one), so a token's arithmetic depends on its position only, however the prompt was
        chunked; and the keys past a tile are skipped, about half the work of a long prompt.
        """
        n, num_keys, dim = q.shape[0], keys.shape[1], self.head_dim
        kv_heads, group = self.num_kv_heads, self.num_heads // self.num_kv_heads
        first = num_keys - n
        padded = -(-num_keys // QUERY_TILE) * QUERY_TILE
        keys32 = F.pad(keys.float(), (0, 0, 0, padded - num_keys))
        values32 = F.pad(values.float(), (0, 0, 0, padded - num_keys))
        out = torch.empty_like(q)
        start = first
        while start < num_keys:
            tile_end = (start // QUERY_TILE + 1) * QUERY_TILE
            stop = min(tile_end, num_keys)
            rows = stop - start
            queries = q[start - first : stop - first].float().reshape(rows, kv_heads, group, dim)
            queries = queries.permute(1, 2, 0, 3).reshape(kv_heads, group * rows, dim)
            scores = torch.matmul(queries, keys32[:, :tile_end].transpose(-1, -2)).mul_(self.scale)
            key = ("tile", start, stop, group, self.window)
            mask = step_cache.get(key)
            if mask is None:
                mask = _group_causal_mask(rows, tile_end, group, q.device, query_end=stop, window=self.window)
                step_cache[key] = mask
            scores.masked_fill_(~mask, float("-inf"))  # type: ignore[operator]
            tile = torch.matmul(scores.softmax(-1), values32[:, :tile_end])
            tile = tile.reshape(kv_heads, group, rows, dim).permute(2, 0, 1, 3)
            out[start - first : stop - first] = tile.reshape(rows, kv_heads * group, dim)
            start = stop
        return out

    def _first_key(self, key_len: int, num_queries: int) -> int:
        """The first cached position a chunk of ``num_queries`` ending at ``key_len`` may attend to,
        rounded down to its block: 0 for a full-attention layer."""
        if self.window is None:
            return 0
        block_size = self.k_cache.shape[1]
        return max(0, key_len - num_queries - self.window + 1) // block_size * block_size

    def _gather_one(
        self, block_table: torch.Tensor, key_len: int, first: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's cached K/V of positions ``first`` (a block's start) to ``key_len`` as
        [KVH, key_len - first, D]. The causal and window masks are the same relative to ``first``, so
        a sliding-window layer reads only the blocks its window reaches (the ones before may be freed)."""
        block_size = self.k_cache.shape[1]
        blocks = block_table[first // block_size : -(-key_len // block_size)].long()
        shape = (-1, self.num_kv_heads, self.head_dim)
        keys = self.k_cache[blocks].reshape(shape)[: key_len - first].transpose(0, 1)
        values = self.v_cache[blocks].reshape(shape)[: key_len - first].transpose(0, 1)
        return keys, values

    def _sdpa_one(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q [n, H, D] against keys/values [KVH, L, D] with a folded mask [G * n, L] -> [n, H, D]."""
        n, kv_heads, dim = q.shape[0], self.num_kv_heads, self.head_dim
        group = self.num_heads // kv_heads
        # [n, KVH, G, D] -> [KVH, G * n, D]: the heads sharing a KV head become extra query rows.
        queries = q.reshape(n, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * n, dim)
        # A leading batch axis: torch's CPU flash kernel takes 4-D inputs only, and 3-D ones fall back
        # to the math path, which materialises [G * n, L] scores (4x slower at 1k x 2k tokens).
        out = F.scaled_dot_product_attention(
            queries.to(keys.dtype)[None], keys[None], values[None], attn_mask=mask, scale=self.scale
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


def _group_causal_mask(
    num_queries: int,
    num_keys: int,
    group: int,
    device: torch.device,
    query_end: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """[G * n, L] bool: query j sits at position ``query_end - n + j`` (``query_end`` defaults to L)
    and sees keys up to it (the last ``window`` of them, with one); repeated for the ``group`` query
    heads folded into the query axis."""
    offset = (num_keys if query_end is None else query_end) - num_queries
    query_pos = torch.arange(num_queries, device=device)[:, None] + offset
    key_pos = torch.arange(num_keys, device=device)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask.expand(group, num_queries, num_keys).reshape(group * num_queries, num_keys)


def set_decode_backend(model: nn.Module, backend: DecodeBackend) -> None:
    """Give every attention layer of ``model`` ``backend`` (the loader does, once)."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend
