"""GGUF's Q8_0 and Q5_0 tile by tile on int8 activations (``q8_0_rows.c``, ``q8_0_tiled_kernels.c`` for
AVX-512 VNNI, ``q8_0_tiled_avx2.c`` for AVX-VNNI and AVX2), where ``ggml_kernels.tiled_isa()`` has the
tiles: the ctypes calls and the plain reference they are tested against, llama.cpp's Q8_0 activation
blocks (:func:`quantize_rows_q8_0_ref`) times gguf's dequantization in float64 (:func:`matmul_ref`).

A weight is the file's rows of blocks, uint8 ``[N, K / 32 * 34]`` (Q8_0) or ``[N, K / 32 * 22]`` (Q5_0),
rearranged in place by :func:`tile` into the kernels' tiles of 16 rows (the same bytes; the last tile may
hold fewer rows), kept in that shape: only the C code reads its layout (``q8_0_rows.c``).

A Q8_0 output head runs the same tiles on int16 activations (:func:`matmul_head`, ``q8_0_head_tiles.c``):
the row-by-row tiles' rows (``kernels.quantize_rows_ref``: one scale a row, 15 bits), whose precision a
head's near-tied token choices need (``ggml_linear.HEADS_ON_INT16_ROWS``).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from engine.cpu import ggml_kernels, kernels
from engine.cpu.ggml_kernels import GGMLType

BLOCK = 32
_BLOCK_BYTES = {GGMLType.Q8_0: 34, GGMLType.Q5_0: 22}


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = kernels._lib()
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.tern_matmul_q8_0_tiled.argtypes = [i32, ptr, i64, i64, ptr, i64, ptr]
    lib.tern_tile_q8_0.argtypes = [i32, ptr, i64, i64]
    lib.tern_dequantize_q8_0_tiled.argtypes = [i32, ptr, i64, i64, ptr, i64, ptr]
    lib.tern_dequantize_q8_0_tiled.restype = None
    lib.tern_quantize_rows_q8_0.argtypes = [ptr, i64, i64, ptr, ptr, ptr]
    lib.tern_quantize_rows_q8_0.restype = None
    lib.tern_matmul_q8_0_head_tiled.argtypes = [ptr, i64, i64, ptr, i64, ptr]
    return lib


def _blocks_per_row(tiled: torch.Tensor, ggml_type: GGMLType) -> int:
    if ggml_type not in _BLOCK_BYTES or tiled.dtype != torch.uint8 or tiled.dim() != 2:
        raise kernels.KernelError(f"not a tiled Q8_0/Q5_0 weight: {ggml_type.name} {tuple(tiled.shape)}")
    if tiled.shape[1] % _BLOCK_BYTES[ggml_type] or not tiled.is_contiguous():
        raise kernels.KernelError(f"{ggml_type.name} rows of {tiled.shape[1]} bytes are not whole blocks")
    return tiled.shape[1] // _BLOCK_BYTES[ggml_type]


def tile(blocks: torch.Tensor, ggml_type: GGMLType) -> torch.Tensor:
    """Q8_0 or Q5_0 rows of blocks [N, K / 32 * block bytes] rearranged in place into the tiles (a C loop a
    tile at a time): the same bytes in the blocks' own memory, returned in the same shape."""
    nb = _blocks_per_row(blocks, ggml_type)
    kernels._check(
        _lib().tern_tile_q8_0(int(ggml_type == GGMLType.Q5_0), blocks.data_ptr(), blocks.shape[0], nb)
    )
    return blocks


def matmul(x: torch.Tensor, tiled: torch.Tensor, ggml_type: GGMLType) -> torch.Tensor:
    """x [M, K] float32 @ dequant(W)^T -> [M, N] float32; W from :func:`tile`."""
    x = kernels._rows(x)
    m, k = x.shape
    n, nb = tiled.shape[0], _blocks_per_row(tiled, ggml_type)
    if nb * BLOCK != k:
        raise kernels.KernelError(
            f"rows of {k} do not fit tiled {ggml_type.name} blocks {tuple(tiled.shape)}"
        )
    out = torch.empty(m, n, dtype=torch.float32)
    q5 = int(ggml_type == GGMLType.Q5_0)
    kernels._check(_lib().tern_matmul_q8_0_tiled(q5, x.data_ptr(), m, k, tiled.data_ptr(), n, out.data_ptr()))
    return out


def matmul_head(x: torch.Tensor, tiled: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ dequant(W)^T -> [M, N] float32 on int16 rows; W Q8_0 from :func:`tile`."""
    x = kernels._rows(x)
    m, k = x.shape
    n, nb = tiled.shape[0], _blocks_per_row(tiled, GGMLType.Q8_0)
    if nb * BLOCK != k:
        raise kernels.KernelError(f"rows of {k} do not fit tiled Q8_0 blocks {tuple(tiled.shape)}")
    out = torch.empty(m, n, dtype=torch.float32)
    kernels._check(
        _lib().tern_matmul_q8_0_head_tiled(x.data_ptr(), m, k, tiled.data_ptr(), n, out.data_ptr())
    )
    return out


def matmul_head_ref(x: torch.Tensor, blocks: np.ndarray | torch.Tensor) -> torch.Tensor:
    """:func:`matmul_head`'s arithmetic in float64: x's int16 rows (``kernels.quantize_rows_ref``; the
    kernel's block products are exact integers) against the Q8_0 weight dequantized by gguf."""
    codes, scales, _ = kernels.quantize_rows_ref(x)
    rows = codes.double() * scales.double()[:, None]
    return (rows @ ggml_kernels.dequantize_ref(blocks, GGMLType.Q8_0).double().t()).float()


def dequantize_rows(tiled: torch.Tensor, ggml_type: GGMLType, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape) of a weight from :func:`tile`, float32 [*ids, K] (a tied head's embedding)."""
    nb = _blocks_per_row(tiled, ggml_type)
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), nb * BLOCK)
    q5 = int(ggml_type == GGMLType.Q5_0)
    _lib().tern_dequantize_q8_0_tiled(
        q5, tiled.data_ptr(), tiled.shape[0], nb, flat.data_ptr(), flat.numel(), out.data_ptr()
    )
    return out.reshape(*ids.shape, nb * BLOCK)


def quantize_rows_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tiles' activation quantizer: x [M, K] -> int8 codes [M, K], a scale a block of 32 [M, K / 32]
    and each block's code sum [M, K / 32] (int32)."""
    x = kernels._rows(x)
    m, k = x.shape
    codes = torch.empty(m, k, dtype=torch.int8)
    scales = torch.empty(m, k // BLOCK)
    sums = torch.empty(m, k // BLOCK, dtype=torch.int32)
    _lib().tern_quantize_rows_q8_0(x.data_ptr(), m, k, codes.data_ptr(), scales.data_ptr(), sums.data_ptr())
    return codes, scales, sums


def quantize_rows_q8_0_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows_q8_0` in plain torch (float32, as the C code): per block of 32, amax = max |x|,
    d = amax / 127, q = round_half_even(x * (127 / amax)) clamped to +-127, 0 where amax is 0."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv[..., None]).clamp(-127, 127)
    return codes.reshape(m, k).to(torch.int8), amax / 127.0, codes.sum(-1).to(torch.int32)


def matmul_ref(x: torch.Tensor, blocks: np.ndarray | torch.Tensor, ggml_type: GGMLType) -> torch.Tensor:
    """The tiles' arithmetic in float64: x's Q8_0 activation blocks (:func:`quantize_rows_q8_0_ref`; their
    integer products are exact in the kernel) against the weight dequantized by gguf."""
    codes, scales, _ = quantize_rows_q8_0_ref(x)
    rows = codes.double() * scales.double().repeat_interleave(BLOCK, dim=1)
    return (rows @ ggml_kernels.dequantize_ref(blocks, ggml_type).double().t()).float()
