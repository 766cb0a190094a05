"""The C kernels of ``quant_kernels.c`` and ``attention_kernels.c``: built with the machine's C
compiler on first use, loaded with ctypes, each with a plain-torch reference (``*_ref``) it is
tested against.

Why C and not torch's weight-only kernels: on a CPU without AVX-512, torch's int4 kernel streams
the weights at about 7 GB/s and costs the same per row at any batch size, and its int8 kernel has
per-output-row scales only. These kernels do what llama.cpp does for GGUF models: quantize each
activation row to integers (int16 here, where llama.cpp takes int8) and take integer dot products
block by block, reading a weight tile once for all the rows of a step (docs/engine.md, "CPU linears").

The shared library is compiled with ``-march=native`` for the CPU it runs on and cached
(``build.py``); building takes a few seconds (4-5 on the 2-core VM). With no C compiler,
:func:`library` returns None and the engine keeps torch's kernels. OpenMP threads are torch's own
(the same libgomp), so ``--num-threads`` applies. Where the CPU has AVX-512 VNNI, q4_1 runs through
its own kernel (weights tile by tile); ``TERN_CPU_VNNI=0`` builds the AVX-512 tiles' q4_1 instead
(:data:`VNNI_ENV`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

# Building and loading live in build.py; their names stay importable from here, where callers and
# tests have always found them.
from engine.cpu.build import AVX512_ENV as AVX512_ENV
from engine.cpu.build import FLAGS as FLAGS
from engine.cpu.build import INCLUDES as INCLUDES
from engine.cpu.build import SOURCES as SOURCES
from engine.cpu.build import VNNI_ENV as VNNI_ENV
from engine.cpu.build import KernelError as KernelError
from engine.cpu.build import _cpu_signature as _cpu_signature
from engine.cpu.build import _lib as _lib
from engine.cpu.build import available as available
from engine.cpu.build import library as library

BLOCK = 32
"""Elements per quantization block along K (weights and activations alike)."""
ACTIVATION_MAX = 32767
"""Activations are quantized to int16 with one scale per row: 15 bits against the row's largest value."""


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise KernelError("the CPU quantized kernels take float32 CPU rows")
    return x.contiguous()


def _check(status: int) -> None:
    if status != 0:
        raise KernelError("out of memory" if status == -1 else f"bad shapes (status {status})")


# -- weight layouts -------------------------------------------------------------------------------


def pack_q4_1(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (0..15) -> [N, K / 2] bytes, GGUF Q4_1's order: byte j of a block holds element
    j in its low nibble and element j + 16 in its high one."""
    n, k = codes.shape
    if k % BLOCK or scales.shape != (n, k // BLOCK) or mins.shape != scales.shape:
        raise KernelError("q4_1 needs whole blocks of 32 along K, one scale and min per block")
    blocks = codes.to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


TILE_N = 16
"""Output columns per tile of the matmul kernels (``TILE_N`` in quant_kernels.c)."""


def tiles_shape(n: int, k: int) -> tuple[int, int, int]:
    return (-(-n // TILE_N), k // BLOCK, TILE_N)


def tile_blocks(values: torch.Tensor) -> torch.Tensor:
    """Per-block values [N, K / 32] (q4_1 mins, or scales for the tiled kernel) -> [N / 16 rounded up,
    K / 32, 16] float16, zero past N: a tile's values block by block, 16 columns a vector load."""
    n, blocks = values.shape
    tiles = tiles_shape(n, blocks * BLOCK)[0]
    padded = torch.zeros(tiles * TILE_N, blocks, dtype=torch.float16)
    padded[:n] = values
    return padded.reshape(tiles, TILE_N, blocks).transpose(1, 2).contiguous()


def tile_q4_1(packed: torch.Tensor) -> torch.Tensor:
    """GGUF-order q4_1 bytes [N, K / 2] -> [N / 16 rounded up, K / 32, 8, 32] bytes, zero past N: chunk
    j of a tile's block holds, at byte 2c + e, column c's element 4j + e in its low nibble and 4j + 2 + e
    in its high one (the VNNI kernel's pairs; ``tiled_q4_1`` in q4_1_tiled_kernels.c)."""
    n, half = packed.shape
    tiles, blocks, _ = tiles_shape(n, half * 2)
    codes = torch.zeros(tiles * TILE_N, half * 2, dtype=torch.uint8)
    codes[:n] = unpack_q4_1(packed)
    # [tile, column, block, chunk j, nibble h, element e] with element 4j + 2h + e of the block
    codes = codes.reshape(tiles, TILE_N, blocks, BLOCK // 4, 2, 2).permute(0, 2, 3, 1, 5, 4)
    return (codes[..., 0] | (codes[..., 1] << 4)).reshape(tiles, blocks, BLOCK // 4, 2 * TILE_N).contiguous()


@functools.cache
def q4_1_tiled() -> bool:
    """Whether the loaded kernels read q4_1 codes and scales tile by tile (the VNNI build)."""
    return bool(_lib().tern_q4_1_tiled())


def q4_1_kernel_layout(
    packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A q4_1 weight from :func:`pack_q4_1` (scales and mins [N, K / 32] float16) as the loaded
    kernels read it: mins always tile by tile, codes and scales too where :func:`q4_1_tiled`."""
    if q4_1_tiled():
        return tile_q4_1(packed), tile_blocks(scales), tile_blocks(mins)
    return packed, scales, tile_blocks(mins)


def unpack_q4_1(packed: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    blocks = packed.reshape(n, half * 2 // BLOCK, BLOCK // 2)
    return torch.stack((blocks & 0x0F, blocks >> 4), dim=2).reshape(n, half * 2)


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> int8 codes [N, K] and one float16 scale per block of 32 [N, K / 32]:
    GGUF's Q8_0 (a Q8_0 tensor dequantized and quantized again gives back its own codes and scales)."""
    n, k = weight.shape
    codes = torch.empty((n, k), dtype=torch.int8)
    scales = torch.empty((n, k // BLOCK), dtype=torch.float16)
    for start in range(0, n, 4096):  # a chunk of rows at a time: no float temporaries of the whole weight
        rows = slice(start, start + 4096)
        blocks = weight[rows].float().reshape(-1, k // BLOCK, BLOCK)
        chunk_scales = blocks.abs().amax(-1) / 127
        inverse = torch.where(chunk_scales == 0, torch.zeros_like(chunk_scales), 1 / chunk_scales)
        codes[rows] = torch.round(blocks * inverse[..., None]).clamp(-127, 127).to(torch.int8).reshape(-1, k)
        scales[rows] = chunk_scales.half()
    return codes, scales


# -- kernels --------------------------------------------------------------------------------------


def _half_scales(*tensors: torch.Tensor) -> None:
    if any(t.dtype != torch.float16 or not t.is_contiguous() for t in tensors):
        raise KernelError("weight scales and mins are contiguous float16 (as GGUF stores them)")


def matmul_q4_1(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """x [M, K] float32 @ dequant(W)^T -> [M, N] float32; W from :func:`pack_q4_1`
    (w = code * scale + min; scales and mins [N, K / 32] float16), laid out for the kernel per call."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    if scales.shape != (n, k // BLOCK) or mins.shape != scales.shape:
        raise KernelError(f"q4_1 scales and mins are [N, K / 32]: {tuple(scales.shape)}, {tuple(mins.shape)}")
    _half_scales(scales, mins)
    return matmul_q4_1_laid_out(x, *q4_1_kernel_layout(qweight, scales, mins), n)


def matmul_q4_1_laid_out(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, n: int
) -> torch.Tensor:
    """:func:`matmul_q4_1` on a weight of N rows already in :func:`q4_1_kernel_layout` (what
    ``Q4CpuLinear`` stores), so that a step pays nothing for the layout."""
    x = _rows(x)
    m, k = x.shape
    tiles = tiles_shape(n, k)
    rows = tiles[0] * TILE_N if q4_1_tiled() else n
    if qweight.numel() * 2 != rows * k or scales.numel() * BLOCK != rows * k or mins.shape != tiles:
        raise KernelError(f"rows of {k} do not fit a q4_1 weight of {n} rows {tuple(qweight.shape)}")
    _half_scales(scales, mins)
    if not qweight.is_contiguous():
        raise KernelError("q4_1 codes are contiguous")
    out = torch.empty(m, n, dtype=torch.float32)
    _check(
        _lib().tern_matmul_q4_1(
            x.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(), mins.data_ptr(), n, out.data_ptr()
        )
    )
    return out


def matmul_q8_0(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ dequant(W)^T -> [M, N] float32; W from :func:`quantize_q8_0`."""
    x = _rows(x)
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.shape[1] != k or scales.shape != (n, k // BLOCK):
        raise KernelError(f"rows of {k} do not fit a q8_0 weight {tuple(qweight.shape)}")
    _half_scales(scales)
    out = torch.empty(m, n, dtype=torch.float32)
    _check(
        _lib().tern_matmul_q8_0(x.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(), n, out.data_ptr())
    )
    return out


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' activation quantizer: x [M, K] -> int16 codes [M, K], one scale per row [M], and
    scale * the sum of each block's codes [M, K / 32]."""
    x = _rows(x)
    m, k = x.shape
    codes = torch.empty(m, k, dtype=torch.int16)
    scales = torch.empty(m)
    sums = torch.empty(m, k // BLOCK)
    _lib().tern_quantize_rows(x.data_ptr(), m, k, codes.data_ptr(), scales.data_ptr(), sums.data_ptr())
    return codes, scales, sums


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One query token per row q [B, H, D] float32 over the first ``context_lens[b]`` keys of its row's
    blocks (``block_tables`` [B, width] int32; caches [blocks, block_size, KVH, D], float32 or
    float16) -> [B, H, D] float32; with a ``window``, over the last ``window`` of them only."""
    q = _rows(q)
    if k_cache.dtype not in (torch.float32, torch.float16) or v_cache.dtype != k_cache.dtype:
        raise KernelError("the decode attention kernel takes float32 or float16 caches")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise KernelError("the decode attention kernel takes contiguous caches")
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    _check(
        _lib().tern_paged_decode_attention(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            int(k_cache.dtype == torch.float16),
            tables.data_ptr(),
            tables.shape[1],
            lens.data_ptr(),
            window or 0,
            batch,
            heads,
            kv_heads,
            dim,
            block_size,
            scale,
            out.data_ptr(),
        )
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., K] / sqrt(mean(x^2) + eps) * weight, in float32."""
    rows = _rows(x).reshape(-1, x.shape[-1])
    out = torch.empty_like(rows)
    _lib().tern_rms_norm(
        rows.data_ptr(), weight.data_ptr(), rows.shape[0], rows.shape[1], eps, out.data_ptr()
    )
    return out.reshape(x.shape)


def decoder_layers(layers: ctypes.Array, hidden: torch.Tensor, step: ctypes.Structure) -> torch.Tensor:
    """Every decoder layer in ``layers`` (a ctypes array of their C structs), one after the other, over
    decode rows hidden [M, E], the step's rows in ``step`` (a ``TernDecodeStep``):
    ``engine/models/llama_decode_kernel.py`` builds both and keeps what they point to alive."""
    hidden = _rows(hidden)
    rows, width = hidden.shape
    out = torch.empty_like(hidden)
    _check(
        _lib().tern_decoder_layers(
            layers, len(layers), hidden.data_ptr(), rows, width, ctypes.byref(step), out.data_ptr()
        )
    )
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in float32, for gate and up [..., K] side by side in one tensor (the two halves
    of a stacked gate/up projection) or each contiguous. Both paths of the fast path call this one
    (torch's SiLU rounds its exponential differently from the C decoder layer's)."""
    return _gated_mul(_lib().tern_silu_mul, gate, up)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gemma's GeGLU, gelu_tanh(gate) * up, as :func:`silu_mul` takes its tensors: both paths of the
    fast path call it (torch's tanh GELU rounds differently from the C decoder layer's)."""
    return _gated_mul(_lib().tern_gelu_tanh_mul, gate, up)


def _gated_mul(kernel: Callable[..., None], gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    k = gate.shape[-1]
    if gate.dtype != torch.float32 or up.dtype != torch.float32 or up.shape != gate.shape:
        raise KernelError("a gated activation takes two float32 tensors of one shape")
    gate2, up2 = gate.reshape(-1, k), up.reshape(-1, k)
    if gate2.stride(1) != 1 or up2.stride(1) != 1 or gate2.stride(0) != up2.stride(0):
        gate2, up2 = gate2.contiguous(), up2.contiguous()
    out = torch.empty(gate2.shape, dtype=torch.float32)
    kernel(gate2.data_ptr(), up2.data_ptr(), gate2.shape[0], k, gate2.stride(0), out.data_ptr())
    return out.reshape(gate.shape)


# -- plain-torch references -----------------------------------------------------------------------


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m = x.shape[0]
    scales = x.float().abs().amax(-1) / ACTIVATION_MAX
    inverse = torch.where(scales == 0, torch.zeros_like(scales), 1 / scales)
    codes = torch.round(x.float() * inverse[:, None])
    return codes.to(torch.int16), scales, scales[:, None] * codes.reshape(m, -1, BLOCK).sum(-1)


def _dequantized_rows(x: torch.Tensor) -> torch.Tensor:
    codes, scales, _ = quantize_rows_ref(x)
    return codes.double() * scales.double()[:, None]


def matmul_q4_1_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """The same arithmetic in float64: quantized activations against the dequantized weight."""
    n, k = qweight.shape[0], x.shape[1]
    w = (
        unpack_q4_1(qweight).double().reshape(n, -1, BLOCK) * scales.double()[..., None]
        + mins.double()[..., None]
    )
    return (_dequantized_rows(x) @ w.reshape(n, k).t()).float()


def matmul_q8_0_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, k = qweight.shape[0], x.shape[1]
    w = qweight.double().reshape(n, -1, BLOCK) * scales.double()[..., None]
    return (_dequantized_rows(x) @ w.reshape(n, k).t()).float()


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    for b in range(batch):
        length = int(context_lens[b])
        first = max(0, length - window) if window else 0
        blocks = block_tables[b, : -(-length // block_size)].long()
        keys = (
            k_cache[blocks]
            .reshape(-1, kv_heads, dim)[first:length]
            .repeat_interleave(heads // kv_heads, dim=1)
        )
        values = (
            v_cache[blocks]
            .reshape(-1, kv_heads, dim)[first:length]
            .repeat_interleave(heads // kv_heads, dim=1)
        )
        keys, values = keys.float(), values.float()
        weights = (torch.einsum("hd,thd->ht", q[b], keys) * scale).softmax(-1)
        out[b] = torch.einsum("ht,thd->hd", weights, values)
    return out


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
