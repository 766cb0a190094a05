"""The ternary (BitNet b1.58) kernels of ``ternary_kernels.c``: weight layouts, the calls, and the
plain-torch references (``*_ref``) they are tested against bit for bit.

The weight is GGUF TQ2_0's codes (``T + 1`` in two bits, four a byte, blocks of 256 along K padded
with zero weights) with either one float scale per weight row (a transformers BitNet checkpoint's
``1 / weight_scale``, or a TQ2_0 tensor whose blocks share one scale) or one float16 scale per block
(TQ2_0 as ``llama-quantize`` writes a float model: each block's absmax). TQ1_0 (1.69 bits: five codes
a byte in base 3) is unpacked into the same codes at load. Activations are BitNet's: int8 per token.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from engine.cpu import kernels

QK = 256
"""Elements per ternary block (GGUF's QK_K)."""
BLOCK_BYTES = QK // 4
TQ2_0_BYTES = BLOCK_BYTES + 2
"""A GGUF TQ2_0 block: 64 bytes of codes, then its float16 scale."""
TQ1_0_BYTES = 48 + 4 + 2
"""A GGUF TQ1_0 block: 48 bytes of five codes each, 4 of four each, then its float16 scale."""
ACT_MAX = 127
ACT_EPS = 1e-5


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = kernels._lib()
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.tern_matmul_tq2.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr]
    lib.tern_quantize_rows_i8.argtypes = [ptr, i64, i64, ptr, ptr, ptr]
    lib.tern_quantize_rows_i8.restype = None
    lib.tern_ternary_avx512_order.argtypes = []
    return lib


def padded(k: int) -> int:
    return -(-k // QK) * QK


# -- layouts --------------------------------------------------------------------------------------


def pack_tq2(values: torch.Tensor) -> torch.Tensor:
    """Ternary values [N, K] (-1, 0, 1) -> codes [N, Kp / 4] uint8 in TQ2_0's order: byte 32c + m of a
    block holds elements 128c + 32j + m in bits 2j; K padded to whole blocks with zero weights."""
    n, k = values.shape
    codes = torch.ones((n, padded(k)), dtype=torch.uint8)
    codes[:, :k] = (values.to(torch.int16) + 1).to(torch.uint8)
    if int(codes.max()) > 2:
        raise ValueError("ternary weights must be -1, 0 or 1")
    groups = codes.reshape(n, -1, 2, 4, 32)  # [row, block, half c, group j, m]
    packed = groups[:, :, :, 0] | groups[:, :, :, 1] << 2 | groups[:, :, :, 2] << 4 | groups[:, :, :, 3] << 6
    return packed.reshape(n, -1).contiguous()


def unpack_tq2(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Codes from :func:`pack_tq2` -> ternary values [N, k] int8."""
    n = packed.shape[0]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 1, 4, 1)
    groups = packed.reshape(n, -1, 2, 1, 32) >> shifts & 3  # [row, block, half, group, m]
    return (groups.reshape(n, -1)[:, :k].to(torch.int8) - 1).contiguous()


def kernel_layout(
    codes: torch.Tensor, block_scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Codes [N, Kp / 4] (and block scales [N, Kp / 256]) in the kernel's layout: the rows in groups
    of four (the last group the N % 4 left), each group's blocks interleaved (block b of its row r
    before block b of row r + 1, then block b + 1), so that four rows at a time read one stream of
    memory. The same shapes and bytes; :func:`natural_layout` undoes it."""
    scales = None if block_scales is None else block_scales.reshape(*block_scales.shape, 1)
    laid_out = _interleave(codes.reshape(codes.shape[0], -1, BLOCK_BYTES))
    return laid_out, None if scales is None else _interleave(scales)


def natural_layout(
    codes: torch.Tensor, block_scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`kernel_layout`'s codes (and block scales) back in row order."""
    scales = None if block_scales is None else block_scales.reshape(*block_scales.shape, 1)
    back = _interleave(codes.reshape(codes.shape[0], -1, BLOCK_BYTES), back=True)
    return back, None if scales is None else _interleave(scales, back=True)


def _interleave(blocks: torch.Tensor, back: bool = False) -> torch.Tensor:
    """[N, nb, B] -> [N, nb * B]: each group of four rows (and the tail's) with its blocks interleaved,
    or (``back``) the other way."""
    n, nb, width = blocks.shape
    full = n - n % 4
    parts = []
    for part in (blocks[:full], blocks[full:]):
        rows = min(4, part.shape[0])
        if rows:
            grouped = part.reshape(-1, nb, rows, width) if back else part.reshape(-1, rows, nb, width)
            parts.append(grouped.transpose(1, 2).reshape(-1, nb * width))
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).contiguous()


def tq2_from_gguf(
    blocks: np.ndarray | torch.Tensor, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw GGUF TQ2_0 bytes of an [N, K] tensor -> (codes [N, K / 4], float16 block scales [N, K / 256]):
    the codes are TQ2_0's own, split from their scales."""
    raw = _blocks(blocks, shape, TQ2_0_BYTES)
    codes = raw[:, :, :BLOCK_BYTES].reshape(shape[0], -1).contiguous()
    return codes, raw[:, :, BLOCK_BYTES:].contiguous().view(torch.float16).reshape(shape[0], -1)


def tq1_values(
    blocks: np.ndarray | torch.Tensor, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw GGUF TQ1_0 bytes of an [N, K] tensor -> (ternary values [N, K] int8, float16 block scales
    [N, K / 256]). A byte holds five codes (four in ``qh``) as a base-3 fraction of 256: code i is
    ``((byte * 3^i mod 256) * 3) >> 8`` (ggml's ``dequantize_row_tq1_0``)."""
    n, k = shape
    raw = _blocks(blocks, shape, TQ1_0_BYTES).to(torch.int32)
    qs, qh = raw[..., :48], raw[..., 48:52]
    powers5 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32)
    first = (qs[..., :32, None] * powers5 & 0xFF) * 3 >> 8  # [n, nb, m, i]: element 32i + m
    second = (qs[..., 32:48, None] * powers5 & 0xFF) * 3 >> 8  # element 160 + 16i + m
    last = (qh[..., None] * powers5[:4] & 0xFF) * 3 >> 8  # element 240 + 4i + m
    codes = torch.cat(
        [
            first.transpose(-1, -2).reshape(n, -1, 160),
            second.transpose(-1, -2).reshape(n, -1, 80),
            last.transpose(-1, -2).reshape(n, -1, 16),
        ],
        dim=-1,
    )
    scales = raw[..., 52:].to(torch.uint8).contiguous().view(torch.float16).reshape(n, -1)
    return (codes.reshape(n, k) - 1).to(torch.int8), scales


def _blocks(blocks: np.ndarray | torch.Tensor, shape: tuple[int, int], block_bytes: int) -> torch.Tensor:
    n, k = shape
    if k % QK:
        raise ValueError(f"GGUF ternary rows are whole blocks of {QK}, not {k}")
    raw = torch.as_tensor(np.ascontiguousarray(blocks)).view(torch.uint8)
    if raw.numel() != n * (k // QK) * block_bytes:
        raise ValueError(f"{raw.numel()} bytes cannot hold a {n}x{k} tensor of {block_bytes}-byte blocks")
    return raw.reshape(n, k // QK, block_bytes)


def shared_scale(block_scales: torch.Tensor) -> torch.Tensor | None:
    """The one scale of each row [N] float32 where every block with a nonzero scale shares it (a BitNet
    model made ternary: a block of zero weights has scale 0 and counts as any), else None."""
    scales = block_scales.float()
    row = scales.amax(dim=1)
    if bool(((scales == row[:, None]) | (scales == 0)).all()):
        return row.contiguous()
    return None


# -- the kernel -----------------------------------------------------------------------------------


def matmul_tq2(
    x: torch.Tensor,
    codes: torch.Tensor,
    row_scales: torch.Tensor | None = None,
    block_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] float32 @ (T * scale)^T -> [M, N] float32; T as :func:`pack_tq2`'s codes, the scale
    per row (``row_scales`` [N] float32) or per block (``block_scales`` [N, Kp / 256] float16)."""
    laid_out, scales = kernel_layout(codes, block_scales)
    return matmul_tq2_laid_out(x, laid_out, row_scales, scales)


def matmul_tq2_laid_out(
    x: torch.Tensor,
    codes: torch.Tensor,
    row_scales: torch.Tensor | None = None,
    block_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`matmul_tq2` on codes and block scales already in :func:`kernel_layout` (what
    ``TernaryCpuLinear`` holds), so that a call pays nothing for the layout."""
    x = kernels._rows(x)
    m, k = x.shape
    n = codes.shape[0]
    if codes.dtype != torch.uint8 or not codes.is_contiguous() or codes.shape[1] * 4 != padded(k):
        raise kernels.KernelError(f"rows of {k} do not fit ternary codes {tuple(codes.shape)}")
    if (row_scales is None) == (block_scales is None):
        raise kernels.KernelError("a ternary weight has row scales or block scales, not both")
    if row_scales is not None and (row_scales.dtype != torch.float32 or row_scales.shape != (n,)):
        raise kernels.KernelError("ternary row scales are float32 [N]")
    if block_scales is not None and (
        block_scales.dtype != torch.float16 or block_scales.shape != (n, padded(k) // QK)
    ):
        raise kernels.KernelError("ternary block scales are float16 [N, K / 256]")
    scales = (row_scales if row_scales is not None else block_scales).contiguous()  # type: ignore[union-attr]
    out = torch.empty(m, n, dtype=torch.float32)
    ws, wd = (scales.data_ptr(), None) if row_scales is not None else (None, scales.data_ptr())
    kernels._check(_lib().tern_matmul_tq2(x.data_ptr(), m, k, codes.data_ptr(), ws, wd, n, out.data_ptr()))
    return out


def quantize_rows_i8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's activation quantizer: x [M, K] -> int8 codes [M, Kp] in natural order, the scales
    127 / absmax [M] and each block's code sum [M, Kp / 256] int32."""
    x = kernels._rows(x)
    m, k = x.shape
    codes = torch.empty(m, padded(k), dtype=torch.int8)
    scales = torch.empty(m)
    sums = torch.empty(m, padded(k) // QK, dtype=torch.int32)
    _lib().tern_quantize_rows_i8(x.data_ptr(), m, k, codes.data_ptr(), scales.data_ptr(), sums.data_ptr())
    if _lib().tern_ternary_avx512_order():  # stored group by group for 64-byte loads: back to natural order
        codes = codes.reshape(m, -1, 4, 2, 32).transpose(2, 3).reshape(m, -1)
    return codes, scales, sums


# -- plain-torch references -----------------------------------------------------------------------


def quantize_rows_i8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' BitLinear activation quantization (and the engine's TernaryLinear torch path)."""
    x = x.float()
    m, k = x.shape
    scales = ACT_MAX / x.abs().amax(dim=-1).clamp(min=ACT_EPS)
    codes = torch.zeros(m, padded(k), dtype=torch.int8)
    codes[:, :k] = (x * scales[:, None]).round().clamp(-ACT_MAX - 1, ACT_MAX).to(torch.int8)
    return codes, scales, codes.reshape(m, -1, QK).sum(-1, dtype=torch.int32)


def matmul_tq2_ref(
    x: torch.Tensor,
    codes: torch.Tensor,
    row_scales: torch.Tensor | None = None,
    block_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel's arithmetic in torch: integer dot products (int64), then the same float operations."""
    k = x.shape[1]
    xq, scales, _ = quantize_rows_i8_ref(x)
    values = unpack_tq2(codes, padded(k)).long()
    if row_scales is not None:
        dots = xq.long() @ values.t()
        return dots.float() / scales[:, None] * row_scales[None, :]
    assert block_scales is not None
    m, n = x.shape[0], codes.shape[0]
    block_dots = torch.einsum("mbk,nbk->mnb", xq.long().reshape(m, -1, QK), values.reshape(n, -1, QK))
    total = torch.zeros(m, n)
    for b in range(block_dots.shape[-1]):
        total = total + block_dots[..., b].float() * block_scales[:, b].float()[None, :]
    return total / scales[:, None]
