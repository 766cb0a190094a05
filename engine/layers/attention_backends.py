"""How decode rows read the paged KV cache: one backend object per attention layer, chosen once at load.

Every backend takes one new token per row, ``q [B, H, D]``, and attends over the first
``context_lens[b]`` cached keys of its row's blocks. Which one a layer holds is decided by the loader
(:func:`engine.loader.build_plan.decode_backend`) from the device and the CPU kernel set, before the
weights are read:

- :class:`TritonDecode` on CUDA: the Triton paged-attention kernel (``engine/kernels``).
- :class:`CDecode` on the float32 CPU fast path: the C kernel of ``engine/cpu``, reading the cache in
  place, which is float16 there (as llama.cpp keeps it: half the bytes a decode step reads).
- :class:`TorchDecode` elsewhere: a gather and one SDPA per key-length bucket.

Prefill chunks take the layer's own torch path whatever the backend (``engine/layers/attention.py``).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from engine.cpu import kernels as cpu_kernels
from engine.layers.context import Context

DECODE_KEY_BUCKET = 128
"""Decode rows are padded to a multiple of this many keys, each to its own (``_decode_groups``)."""


class DecodeBackend(Protocol):
    name: str
    graph_safe: bool
    """Reads the step only from the context's device tensors (never its host lists), so a decode step
    can be captured once as a CUDA graph and replayed with new tables and lengths
    (``engine/core/cuda_graphs.py``)."""

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for a model computing in ``model_dtype``."""
        ...

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: Context,
        rows: list[int] | None,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """Decode rows q [B, H, D] of the step's sequences ``rows`` (None: all of them) -> [B, H, D];
        with a ``window``, each row attends to its last ``window`` keys only."""
        ...


def _tables_and_lens(
    ctx: Context, rows: list[int] | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    tables, lens = ctx.block_tables, ctx.context_lens
    if tables is None or lens is None:
        raise RuntimeError("a paged decode step needs block tables and context lengths in its context")
    if rows is not None:
        index = torch.tensor(rows, device=device)
        tables, lens = tables[index], lens[index]
    return tables, lens


class TritonDecode:
    """CUDA: the Triton paged-attention kernel."""

    name = "triton"
    graph_safe = True

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: Context,
        rows: list[int] | None,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        from engine.kernels.paged_attention import paged_attention  # Triton: imported only where used

        tables, lens = _tables_and_lens(ctx, rows, q.device)
        return paged_attention(q, k_cache, v_cache, tables, lens, scale, window)


class CDecode:
    """The float32 CPU fast path: the C kernel over a float16 cache, in place."""

    name = "c"
    graph_safe = False  # a CPU kernel: nothing to capture

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.float16 if model_dtype == torch.float32 else model_dtype

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: Context,
        rows: list[int] | None,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        tables, lens = _tables_and_lens(ctx, rows, q.device)
        return cpu_kernels.paged_decode_attention(
            q.float(), k_cache, v_cache, tables, lens, scale, window
        ).to(q.dtype)


class TorchDecode:
    """Any device: the rows' blocks gathered and one SDPA per key-length bucket."""

    name = "torch"
    graph_safe = False  # groups rows by the host-side lengths

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: Context,
        rows: list[int] | None,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        # The groups, gather indexes and masks are the same for every layer; build them once per step.
        key = ("decode", None if rows is None else tuple(rows), window)
        groups = ctx.cache.get(key)
        if groups is None:
            groups = ctx.cache[key] = _decode_groups(ctx, rows, k_cache.shape[1], q.device, window)
        kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
        heads = q.shape[1]
        queries = q.reshape(q.shape[0], kv_heads, heads // kv_heads, dim).to(k_cache.dtype)
        out = torch.empty_like(queries)
        for members, block_index, mask in groups:  # type: ignore[attr-defined]
            batch = members.shape[0]
            keys = k_cache.index_select(0, block_index).view(batch, -1, kv_heads, dim).transpose(1, 2)
            values = v_cache.index_select(0, block_index).view(batch, -1, kv_heads, dim).transpose(1, 2)
            out[members] = F.scaled_dot_product_attention(
                queries[members], keys, values, attn_mask=mask, scale=scale
            )
        return out.reshape(q.shape[0], heads, dim).to(q.dtype)


def _decode_groups(
    ctx: Context, rows: list[int] | None, block_size: int, device: torch.device, window: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Decode rows grouped by their key count rounded up to ``DECODE_KEY_BUCKET``: for each group the
    rows ([b] int64), the flat block list to gather ([b * nb] int64) and the padding mask
    ([b, 1, 1, L] bool).

    A row is padded to its own bucket, whatever else is in the batch, and always masked: SDPA's
    kernel splits its work by the key count, so padding a row to the batch's longest sequence made
    its result, and then greedy tokens, depend on the batch. Rows also gather less padding."""
    lens = ctx.context_lens_host if rows is None else [ctx.context_lens_host[i] for i in rows]
    assert ctx.block_tables is not None
    tables = ctx.block_tables if rows is None else ctx.block_tables[torch.tensor(rows, device=device)]
    bucket = max(DECODE_KEY_BUCKET, block_size)
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lens):
        by_length.setdefault(-(-n // bucket) * bucket, []).append(i)
    groups = []
    for padded, members in sorted(by_length.items()):
        index = torch.tensor(members, device=device)
        num_blocks = padded // block_size
        table = tables[index, :num_blocks].clamp(min=0).long()
        table = F.pad(table, (0, num_blocks - table.shape[1]))  # blocks past the table: block 0, masked
        key_pos = torch.arange(padded, device=device)[None, :]
        ends = torch.tensor([lens[i] for i in members], device=device)[:, None]
        mask = key_pos < ends
        if window is not None:
            mask &= key_pos >= ends - window
        groups.append((index, table.reshape(-1), mask[:, None, None, :]))
    return groups
