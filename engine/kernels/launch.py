"""Launch plumbing shared by the quantized matmul kernels (INT4 and ternary).

Both kernels have the same two launch shapes: a split-K **decode** launch for ``M <= DECODE_MAX_M``
(fp32 partial sums combined with ``atomic_add`` into a zeroed buffer) and a tiled **GEMM** launch
(one program per output tile, direct store). Their launch configs come from
``engine/kernels/tuning.py`` (a fixed space per kernel and the committed table), never from an
autotuner.
"""

from __future__ import annotations

import torch
import triton

from engine.kernels.tuning import DECODE_MAX_M, LaunchConfig

__all__ = ["DECODE_MAX_M", "matmul_grid", "output_buffer"]


def matmul_grid(m: int, n: int, config: LaunchConfig) -> tuple[int, int]:
    """Programs over ``[M, N]`` output tiles, times ``SPLIT_K`` along the second axis."""
    tiles = triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
    return (tiles, config["SPLIT_K"])


def output_buffer(x: torch.Tensor, m: int, n: int, decode: bool) -> torch.Tensor:
    """``[m, n]``: zeroed fp32 for the decode launch's ``atomic_add``, else uninitialised in ``x``'s dtype."""
    if decode:
        return torch.zeros((m, n), device=x.device, dtype=torch.float32)
    return x.new_empty((m, n))
