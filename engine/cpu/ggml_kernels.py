"""The C kernels for GGUF's own blocks, by GGML type: which ones run in their own layout
(:data:`KERNEL_TYPES`), the ctypes calls (``kquant_kernels.c`` for Q4_K/Q5_K/Q6_K, ``quant_kernels.c``'s
Q8_0 and Q5_0), and the plain reference each is tested against: gguf's dequantization, then a
float64 matmul over the kernels' activations: int16 for the row-by-row kernels (:func:`matmul_ref`),
llama.cpp's Q8_K for the tiles (:func:`matmul_ref_q8k`; AVX2 and AVX-512 VNNI alike).

A weight is the file's rows of blocks, uint8 ``[N, bytes per row]``, except Q8_0 and Q5_0, which the
kernels read as codes and float16 scales ``[N, K / 32]`` apart: Q8_0's int8 codes ``[N, K]``
(:func:`q8_0_from_blocks`), Q5_0's fifth bits and nibbles ``[N, K / 32 * 20]`` (:func:`q5_0_from_blocks`),
the same bytes split in place.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from engine.cpu import kernels

GGMLType = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class KernelFormat:
    """How the C kernels run one GGML type."""

    name: str
    """The format the decoder-layer structs and ``GgmlLinear.format`` carry."""
    c_id: int
    """Its number in the C dispatch (``tern_matmul_ggml``, layer_kernels.c)."""
    block_elements: int
    """Elements per block along K: K must be a multiple."""


# The one table: GGML type -> the kernel that runs it in its own blocks (docs/engine.md, "GGUF types").
# Q4_0/Q4_1 keep their own path (Int4Linear -> Q4CpuLinear, c_id 1 in layer_kernels.c).
KERNEL_TYPES: dict[GGMLType, KernelFormat] = {
    GGMLType.Q8_0: KernelFormat("q8_0", 0, 32),
    GGMLType.Q5_0: KernelFormat("q5_0", 9, 32),
    GGMLType.Q4_K: KernelFormat("q4_k", 2, 256),
    GGMLType.Q5_K: KernelFormat("q5_k", 3, 256),
    GGMLType.Q6_K: KernelFormat("q6_k", 4, 256),
}
Q4_K_TILED = KernelFormat("q4_k_tiled", 6, 256)
Q6_K_TILED = KernelFormat("q6_k_tiled", 7, 256)
Q5_K_TILED = KernelFormat("q5_k_tiled", 8, 256)
Q8_0_TILED = KernelFormat("q8_0_tiled", 10, 32)
Q5_0_TILED = KernelFormat("q5_0_tiled", 11, 32)
TILED_FORMATS = {
    GGMLType.Q4_K: Q4_K_TILED,
    GGMLType.Q5_K: Q5_K_TILED,
    GGMLType.Q6_K: Q6_K_TILED,
    GGMLType.Q8_0: Q8_0_TILED,
    GGMLType.Q5_0: Q5_0_TILED,
}
"""Types rearranged tile by tile for their tiled kernels on int8 activations, where the build has them
(:func:`tiled_isa`: AVX2 and up): Q4_K, Q5_K and Q6_K (:func:`tile`) where the rows fill whole tiles of
16; Q8_0 and Q5_0 (``q8_0_tiles.tile``, any number of rows: the last tile may be short)."""
ANY_ROWS = frozenset({GGMLType.Q8_0, GGMLType.Q5_0})
"""The tiled types whose last tile may have fewer than 16 rows."""
TILED_ISAS = {0: None, 1: "avx2", 2: "avx-vnni", 3: "avx512-vnni"}
"""``tern_kquant_tiles()`` -> the instruction set the K-quant tiles of this build use (q8k_rows.c): AVX2's
vpmaddubsw + vpmaddwd (kquant_tiled_avx2.c, q6_k_tiled_avx2.c), the same with 256-bit VNNI's vpdpbusd, or
AVX-512 VNNI (kquant_tiled_kernels.c, q6_k_tiled_kernels.c); None: the row-by-row kernels only."""
_KQUANT_TYPE = {GGMLType.Q4_K: 0, GGMLType.Q5_K: 1, GGMLType.Q6_K: 2}
"""The type argument of tern_matmul_kquant."""


def kernel_format(ggml_type: GGMLType, in_features: int) -> KernelFormat | None:
    """The kernel for a linear of this type and width, or None (it is dequantized instead)."""
    spec = KERNEL_TYPES.get(ggml_type)
    if spec is None or in_features % spec.block_elements or not kernels.available():
        return None
    return spec


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = kernels._lib()
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.tern_matmul_kquant.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr]
    lib.tern_matmul_q5_0.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr]
    lib.tern_matmul_k_tiled.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr]
    lib.tern_matmul_q6_k_tiled.argtypes = [ptr, i64, i64, ptr, i64, ptr]
    lib.tern_tile_k.argtypes = [ctypes.c_int, ptr, i64, i64]
    lib.tern_tile_q6_k.argtypes = [ptr, i64, i64]
    lib.tern_dequantize_q6_k_tiled.argtypes = [ptr, i64, ptr, i64, ptr]
    lib.tern_dequantize_q6_k_tiled.restype = None
    lib.tern_quantize_rows_q8k.argtypes = [ptr, i64, i64, ptr, ptr, ptr]
    lib.tern_quantize_rows_q8k.restype = None
    lib.tern_kquant_tiles.argtypes = []
    return lib


@functools.cache
def tiled_isa() -> str | None:
    """Which K-quant tiles the loaded kernels run (:data:`TILED_ISAS`), None where none are built."""
    return TILED_ISAS[int(_lib().tern_kquant_tiles())] if kernels.available() else None


CONVERTED_TO_Q8_0: frozenset[tuple[str | None, GGMLType]] = frozenset()
"""(:func:`tiled_isa`, GGML type) pairs whose blocks are dequantized at load and served as Q8_0 (the
float path's ``Q8CpuLinear``) because that measured faster than their own kernel on such a CPU. None
today: on AVX2 each K-quant's tiles take fewer instructions a multiply-add than its row-by-row kernel and
than Q8_0's, or as many (Q5_K at 64 rows: +2%) for two thirds of Q8_0's bytes (docs/engine.md, "GGUF
types": callgrind, bench/engine/kquant_callgrind/run.sh); AVX-512 VNNI measured in tokens a second."""


def serving_path(ggml_type: GGMLType) -> str:
    """How the C kernels' path serves a GGML type on this CPU: ``tiled`` (own blocks, tile by tile),
    ``rows`` (own blocks, row by row), ``q8_0`` (converted at load), or ``dequantized`` (no kernel)."""
    isa = tiled_isa()
    if ggml_type not in KERNEL_TYPES or not kernels.available():
        return "dequantized"
    if (isa, ggml_type) in CONVERTED_TO_Q8_0:
        return "q8_0"
    return "tiled" if ggml_type in TILED_FORMATS and isa is not None else "rows"


def serving_paths() -> dict[str, str]:
    """Every type with a kernel -> its path on this CPU, and the ISA of the tiles (the engine's startup
    log and /health)."""
    paths = {ggml_type.name: serving_path(ggml_type) for ggml_type in KERNEL_TYPES}
    return {"tiles_isa": tiled_isa() or "none", **paths}


def row_bytes(ggml_type: GGMLType, in_features: int) -> int:
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
    return in_features // block_elements * block_bytes


def matmul_kquant(x: torch.Tensor, blocks: torch.Tensor, ggml_type: GGMLType) -> torch.Tensor:
    """x [M, K] float32 @ dequant(W)^T -> [M, N] float32; W Q4_K/Q5_K/Q6_K rows of blocks [N, row bytes]."""
    x = kernels._rows(x)
    m, k = x.shape
    n = blocks.shape[0]
    if (
        blocks.dtype != torch.uint8
        or blocks.shape[1] != row_bytes(ggml_type, k)
        or not blocks.is_contiguous()
    ):
        raise kernels.KernelError(f"rows of {k} do not fit {ggml_type.name} blocks {tuple(blocks.shape)}")
    out = torch.empty(m, n, dtype=torch.float32)
    kernels._check(
        _lib().tern_matmul_kquant(
            _KQUANT_TYPE[ggml_type], x.data_ptr(), m, k, blocks.data_ptr(), n, out.data_ptr()
        )
    )
    return out


TILE_N = 16


_SB_BYTES = {GGMLType.Q4_K: 144, GGMLType.Q5_K: 176, GGMLType.Q6_K: 210}


def tiles(ggml_type: GGMLType, out_features: int) -> bool:
    """Whether a weight of this type and rows runs tile by tile (:func:`tile`, ``q8_0_tiles.tile``)."""
    whole = out_features % TILE_N == 0 or ggml_type in ANY_ROWS
    return ggml_type in TILED_FORMATS and whole and tiled_isa() is not None


def tile(blocks: torch.Tensor, ggml_type: GGMLType) -> torch.Tensor:
    """Q4_K, Q5_K or Q6_K rows of blocks [N, K / 256 * block bytes] (N a multiple of 16) rearranged in place
    into the tiled kernel's layout (kquant_tiled_kernels.c, q6_k_tiled_kernels.c: per tile of 16 rows
    and super-block, the 16 columns' scales, then the codes paired for vpdpwssd): the same bytes in
    another order, in the blocks' own memory, a tile at a time. Returns it as [N / 16, K / 256, bytes]."""
    n, row = blocks.shape
    sb_bytes = _SB_BYTES[ggml_type]
    if n % TILE_N or row % sb_bytes or blocks.dtype != torch.uint8 or not blocks.is_contiguous():
        raise kernels.KernelError(
            f"{ggml_type.name} tiles need whole tiles of 16 rows, not {tuple(blocks.shape)}"
        )
    if ggml_type == GGMLType.Q6_K:
        kernels._check(_lib().tern_tile_q6_k(blocks.data_ptr(), n, row // sb_bytes))
    else:
        kernels._check(
            _lib().tern_tile_k(int(ggml_type == GGMLType.Q5_K), blocks.data_ptr(), n, row // sb_bytes)
        )
    return blocks.view(n // TILE_N, row // sb_bytes, TILE_N * sb_bytes)


def matmul_tiled(x: torch.Tensor, tiled: torch.Tensor, ggml_type: GGMLType) -> torch.Tensor:
    """x [M, K] float32 @ dequant(W)^T -> [M, N]; W Q4_K, Q5_K or Q6_K from :func:`tile`."""
    x = kernels._rows(x)
    m, k = x.shape
    count, nsb, _ = tiled.shape
    if nsb * 256 != k or not tiled.is_contiguous():
        raise kernels.KernelError(
            f"rows of {k} do not fit tiled {ggml_type.name} blocks {tuple(tiled.shape)}"
        )
    out = torch.empty(m, count * TILE_N, dtype=torch.float32)
    args = (x.data_ptr(), m, k, tiled.data_ptr(), count * TILE_N, out.data_ptr())
    if ggml_type == GGMLType.Q6_K:
        kernels._check(_lib().tern_matmul_q6_k_tiled(*args))
    else:
        kernels._check(_lib().tern_matmul_k_tiled(int(ggml_type == GGMLType.Q5_K), *args))
    return out


def dequantize_q6_k_tiled(tiled: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape) of a Q6_K weight from :func:`tile`, float32 [*ids, K]."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    nsb = tiled.shape[1]
    out = torch.empty(flat.numel(), nsb * 256)
    _lib().tern_dequantize_q6_k_tiled(tiled.data_ptr(), nsb, flat.data_ptr(), flat.numel(), out.data_ptr())
    return out.reshape(*ids.shape, nsb * 256)


def _split_in_place(blocks: np.ndarray | torch.Tensor, block_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of blocks [N, K / 32 * block_bytes] whose first 2 bytes are a float16 scale -> the rest of
    each block [N, K / 32 * (block_bytes - 2)] uint8 and the scales [N, K / 32] float16, in the blocks'
    own memory (rearranged in place: a view of the file's copy-on-write mapping stays the only copy;
    the caller's array is consumed)."""
    raw = torch.as_tensor(blocks)
    n = raw.shape[0]
    split = raw.reshape(n, -1, block_bytes)
    scales = split[..., :2].clone()
    codes = split[..., 2:].clone()
    flat = raw.reshape(-1) if raw.is_contiguous() else raw.contiguous().reshape(-1)
    flat[: codes.numel()] = codes.reshape(-1)
    flat[codes.numel() :] = scales.reshape(-1)
    return flat[: codes.numel()].reshape(n, -1), flat[codes.numel() :].view(torch.float16).reshape(n, -1)


def q8_0_from_blocks(blocks: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows of blocks [N, K / 32 * 34] -> int8 codes [N, K] and float16 scales [N, K / 32], split
    in place (:func:`_split_in_place`)."""
    codes, scales = _split_in_place(blocks, 34)
    return codes.view(torch.int8), scales


def q5_0_from_blocks(blocks: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0 rows of blocks [N, K / 32 * 22] -> each block's four bytes of fifth bits and sixteen of
    nibbles [N, K / 32 * 20] and float16 scales [N, K / 32], split in place (the kernel's layout:
    ``tern_matmul_q5_0``)."""
    return _split_in_place(blocks, 22)


def q5_0_blocks(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """:func:`q5_0_from_blocks` undone for some rows: GGUF's Q5_0 blocks [rows, K / 32 * 22], new memory."""
    rows = codes.shape[0]
    halves = scales.contiguous().view(torch.uint8).reshape(rows, -1, 2)
    return torch.cat((halves, codes.reshape(rows, -1, 20)), dim=-1).reshape(rows, -1)


def matmul_q5_0(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ dequant(W)^T -> [M, N] float32; W from :func:`q5_0_from_blocks`."""
    x = kernels._rows(x)
    m, k = x.shape
    n = codes.shape[0]
    if (
        k % 32
        or codes.dtype != torch.uint8
        or codes.shape != (n, k // 32 * 20)
        or scales.shape != (n, k // 32)
        or scales.dtype != torch.float16
        or not codes.is_contiguous()
        or not scales.is_contiguous()
    ):
        raise kernels.KernelError(f"rows of {k} do not fit a q5_0 weight {tuple(codes.shape)}")
    out = torch.empty(m, n, dtype=torch.float32)
    kernels._check(
        _lib().tern_matmul_q5_0(x.data_ptr(), m, k, codes.data_ptr(), scales.data_ptr(), n, out.data_ptr())
    )
    return out


# -- plain references -----------------------------------------------------------------------------


def dequantize_ref(blocks: np.ndarray | torch.Tensor, ggml_type: GGMLType) -> torch.Tensor:
    """gguf's own dequantization: rows of blocks -> float32 [N, K]."""
    raw = np.asarray(torch.as_tensor(blocks).numpy())
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, ggml_type), dtype=np.float32))


def matmul_ref(x: torch.Tensor, blocks: np.ndarray | torch.Tensor, ggml_type: GGMLType) -> torch.Tensor:
    """The kernels' arithmetic in float64: x's int16 rows (``kernels.quantize_rows_ref``) against the
    weight dequantized by gguf."""
    codes, scales, _ = kernels.quantize_rows_ref(x)
    rows = codes.double() * scales.double()[:, None]
    return (rows @ dequantize_ref(blocks, ggml_type).double().t()).float()


Q8K_BLOCK = 256


def quantize_rows_q8k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tiles' activation quantizer (AVX2 and AVX-512 builds): x [M, K] -> int8 codes [M, K], a scale a
    block of 256 [M, K / 256] and each 16 codes' sum [M, K / 16]."""
    x = kernels._rows(x)
    m, k = x.shape
    codes = torch.empty(m, k, dtype=torch.int8)
    scales = torch.empty(m, k // Q8K_BLOCK)
    sums = torch.empty(m, k // 16, dtype=torch.int16)
    _lib().tern_quantize_rows_q8k(x.data_ptr(), m, k, codes.data_ptr(), scales.data_ptr(), sums.data_ptr())
    return codes, scales, sums


def quantize_rows_q8k_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows_q8k` in plain torch (float32, as the C code): per block of 256, amax = max |x|,
    d = amax / 127, q = round_half_even(x * (127 / amax)) clamped to +-127, 0 where amax is 0."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // Q8K_BLOCK, Q8K_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv[..., None]).clamp(-127, 127).reshape(m, k)
    return codes.to(torch.int8), amax / 127.0, codes.reshape(m, k // 16, 16).sum(-1).to(torch.int16)


def matmul_ref_q8k(x: torch.Tensor, blocks: np.ndarray | torch.Tensor, ggml_type: GGMLType) -> torch.Tensor:
    """The tiles' arithmetic in float64: x's Q8_K rows (:func:`quantize_rows_q8k_ref`; their integer
    products are exact in the kernel) against the weight dequantized by gguf."""
    codes, scales, _ = quantize_rows_q8k_ref(x)
    rows = codes.double() * scales.double().repeat_interleave(Q8K_BLOCK, dim=1)
    return (rows @ dequantize_ref(blocks, ggml_type).double().t()).float()


# -- random weights (tests and benchmarks) ---------------------------------------------------------

# byte offsets of each type's float16 scales in its block (the rest may be any bytes)
_HALVES = {
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
    GGMLType.Q8_0: (0,),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
}


def random_blocks(
    ggml_type: GGMLType, rows: int, width: int, seed: int = 0, scale: float = 1.0
) -> np.ndarray:
    """uint8 [rows, bytes per row] of random blocks of ``ggml_type`` for rows of ``width`` (gguf cannot
    quantize to the K-quants): random bytes with finite, small float16 scales, every such block valid."""
    generator = np.random.default_rng(seed)
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
    raw = generator.integers(0, 256, size=(rows, width // block_elements, block_bytes), dtype=np.uint8)
    # weights of order `scale / sqrt(width)`: a code times d (times a 6-bit sub-scale for the K-quants)
    divisor = {GGMLType.Q4_K: 300, GGMLType.Q5_K: 600, GGMLType.Q6_K: 1000}.get(ggml_type, 8)
    typical = scale / np.sqrt(width) / divisor
    for offset in _HALVES[ggml_type]:
        halves = generator.uniform(0.5, 1.5, size=raw.shape[:2]) * typical
        raw[..., offset : offset + 2] = halves.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)
