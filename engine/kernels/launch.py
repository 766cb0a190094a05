"""Launch plumbing shared by the quantized matmul kernels (INT4 and ternary).

Both kernels have the same two launch shapes: a split-K **decode** launch for ``M <= DECODE_MAX_M``
(fp32 partial sums combined with ``atomic_add`` into a zeroed buffer) and a tiled **GEMM** launch
(one program per output tile, direct store). Their grids, output buffers and autotune spaces differ
only in which ``BLOCK_K`` and split-K values fit the weight layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import triton

DECODE_MAX_M = 16
"""Batches up to this many rows take the split-K decode launch (one 16-row tile)."""


def decode_configs(block_ks: Sequence[int], split_ks: Sequence[int]) -> list[triton.Config]:
    """Autotune space of the decode launch."""
    return [
        triton.Config({"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk}, num_warps=w, num_stages=s)
        for bn in (32, 64, 128)
        for bk in block_ks
        for sk in split_ks
        for w, s in ((4, 3), (4, 4), (8, 4))
    ]


def gemm_configs(block_ks: Sequence[int]) -> list[triton.Config]:
    """Autotune space of the GEMM launch."""
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1}, num_warps=w, num_stages=s)
        for bm, bn in ((32, 64), (64, 64), (64, 128), (128, 64), (128, 128))
        for bk in block_ks
        for w, s in ((4, 3), (8, 3), (4, 4))
    ]


def interpreter_config(decode: bool, block_k: int) -> dict[str, int]:
    """The fixed launch used in Triton's CPU interpreter, where autotuning needs a driver it lacks."""
    return {"BLOCK_M": 16 if decode else 32, "BLOCK_N": 32, "BLOCK_K": block_k, "SPLIT_K": 2 if decode else 1}


def matmul_grid(m: int, n: int) -> Callable[[dict], tuple[int, int]]:
    """Programs over ``[M, N]`` output tiles, times ``SPLIT_K`` along the second axis."""

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])

    return grid


def output_buffer(x: torch.Tensor, m: int, n: int, decode: bool) -> torch.Tensor:
    """``[m, n]``: zeroed fp32 for the decode launch's ``atomic_add``, else uninitialised in ``x``'s dtype."""
    if decode:
        return torch.zeros((m, n), device=x.device, dtype=torch.float32)
    return x.new_empty((m, n))
