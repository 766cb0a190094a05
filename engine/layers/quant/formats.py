"""Checkpoint layouts -> canonical quantized weights (:mod:`engine.layers.quant.weights`).

Each function takes the tensors as stored in the checkpoint and only reorders bits; no value is
re-quantized, so a loaded model computes with exactly the weights its checkpoint holds.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.cpu import ternary
from engine.layers.quant.weights import Int4Weight, TernaryBlockWeight, TernaryWeight

# AutoAWQ's GEMM kernel packs output column ``8c + AWQ_ORDER[i]`` into nibble ``i`` of word ``c``.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)

GGUF_BLOCK = 32
_GGUF_BLOCK_BYTES = {"Q4_0": 2 + 16, "Q4_1": 2 + 2 + 16}


def _unpack_awq_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C/8]`` in AWQ order -> uint8 ``[R, C]`` in natural column order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.to(torch.int32)[:, :, None] >> shifts) & 0xF  # [R, C/8, 8] by nibble index
    reorder = torch.tensor(AWQ_REVERSE_ORDER, device=packed.device)
    return nibbles[:, :, reorder].reshape(packed.shape[0], -1).to(torch.uint8)


def int4_from_awq_gemm(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    shape: tuple[int, int] | None = None,
) -> Int4Weight:
    """AutoAWQ ``WQLinear_GEMM`` tensors (``qweight [K, N/8]``, ``qzeros [K/G, N/8]`` int32,
    ``scales [K/G, N]`` fp16; ``w = (q - zero) * scale``) -> :class:`Int4Weight`.

    ``shape`` is the layer's ``[N, K]`` when the tensors are padded beyond it (K to a whole group,
    N to a multiple of 8, as :func:`awq_gemm_from_int4` writes layers AutoAWQ cannot hold); the
    padding is dropped.
    """
    codes = _unpack_awq_nibbles(qweight)  # [K, N]
    zeros = _unpack_awq_nibbles(qzeros).float()  # [K/G, N]
    if codes.shape[0] != zeros.shape[0] * group_size or tuple(scales.shape) != tuple(zeros.shape):
        raise ValueError(
            f"AWQ tensors do not agree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)}, group {group_size}"
        )
    k_held, n_held = codes.shape
    n, k = (n_held, k_held) if shape is None else shape
    if not (n_held - 8 < n <= n_held and k_held - group_size < k <= k_held):
        raise ValueError(f"AWQ qweight {tuple(qweight.shape)} cannot hold a {n}x{k} layer (G={group_size})")
    scale = scales.float()[:, :n]
    return Int4Weight(
        codes=codes[:k, :n].t().contiguous(),
        scales=scale.t().contiguous(),
        mins=(-zeros[:, :n] * scale).t().contiguous(),
        group_size=group_size,
    )


def awq_gemm_from_int4(weight: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:class:`Int4Weight` with integer zero points (RTN, AWQ) -> AutoAWQ GEMM ``(qweight, qzeros,
    scales)``, the inverse of :func:`int4_from_awq_gemm`.

    Layers whose K is not a whole number of groups, or whose N is not a multiple of 8, are padded
    (zero codes, zero scales): plain AutoAWQ cannot hold them, our loader crops them back.
    """
    n, k = weight.codes.shape
    g = weight.group_size
    zeros_exact = -weight.mins.float() / weight.scales.float().clamp(min=torch.finfo(torch.float32).tiny)
    zeros = zeros_exact.round()
    if (zeros - zeros_exact).abs().max() > 0.1 or zeros.min() < 0 or zeros.max() > 15:
        raise ValueError("AutoAWQ needs integer zero points in 0..15; these mins are not -zero * scale")
    n_pad, k_pad = -(-n // 8) * 8, weight.scales.shape[1] * g
    device = weight.codes.device
    codes = torch.zeros((k_pad, n_pad), dtype=torch.int32, device=device)
    codes[:k, :n] = weight.codes.t().to(torch.int32)
    zero_codes = torch.zeros((k_pad // g, n_pad), dtype=torch.int32, device=device)
    zero_codes[:, :n] = zeros.t().to(torch.int32)
    scales = torch.zeros((k_pad // g, n_pad), dtype=torch.float16, device=device)
    scales[:, :n] = weight.scales.t().to(torch.float16)
    return _pack_awq_nibbles(codes), _pack_awq_nibbles(zero_codes), scales


def _pack_awq_nibbles(values: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` (0..15) in natural column order -> ``[R, C/8]`` in AWQ's nibble order."""
    grouped = values.reshape(values.shape[0], -1, 8)[:, :, list(AWQ_ORDER)]  # nibble i <- column AWQ_ORDER[i]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=values.device)
    return (grouped << shifts).sum(dim=-1, dtype=torch.int32)


def int4_from_gguf(blocks: np.ndarray | torch.Tensor, shape: tuple[int, int], quant_type: str) -> Int4Weight:
    """Raw GGUF ``Q4_0``/``Q4_1`` bytes of a ``[N, K]`` tensor (``[N, K/32 * block_bytes]`` uint8)
    -> :class:`Int4Weight` with group 32. Q4_0 is ``w = d * (q - 8)``, Q4_1 ``w = d * q + m``."""
    if quant_type not in _GGUF_BLOCK_BYTES:
        raise ValueError(f"unsupported GGUF type {quant_type!r}; expected Q4_0 or Q4_1")
    n, k = shape
    if k % GGUF_BLOCK:
        raise ValueError(f"GGUF {quant_type} rows must be a multiple of {GGUF_BLOCK}, got {k}")
    raw = torch.as_tensor(np.ascontiguousarray(blocks)).view(torch.uint8).reshape(n, k // GGUF_BLOCK, -1)
    if raw.shape[-1] != _GGUF_BLOCK_BYTES[quant_type]:
        raise ValueError(f"{quant_type} blocks must be {_GGUF_BLOCK_BYTES[quant_type]} bytes")
    d = raw[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    if quant_type == "Q4_0":
        mins, qs = -8 * d, raw[..., 2:]
    else:
        mins, qs = raw[..., 2:4].contiguous().view(torch.float16)[..., 0].float(), raw[..., 4:]
    # Byte j of a block holds element j (low nibble) and element j + 16 (high nibble).
    codes = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(n, k)
    return Int4Weight(codes=codes, scales=d, mins=mins, group_size=GGUF_BLOCK)


def ternary_from_bitnet(weight: torch.Tensor, weight_scale: torch.Tensor, out_features: int) -> TernaryWeight:
    """transformers' packed BitNet weight -> :class:`TernaryWeight`.

    ``weight`` is uint8 ``[ceil(N/4), K]``: bits ``2i`` of row ``r`` hold ``value + 1`` of output row
    ``i * ceil(N/4) + r``. The layer computes ``y / weight_scale``, so ``scale = 1 / weight_scale``.
    """
    rows = weight.shape[0]
    if rows * 4 < out_features or (rows - 1) * 4 >= out_features:
        raise ValueError(f"packed BitNet weight {tuple(weight.shape)} cannot hold {out_features} rows")
    planes = [((weight >> (2 * i)) & 0x3) for i in range(4)]
    values = (torch.cat(planes, dim=0)[:out_features].to(torch.int8) - 1).contiguous()
    return TernaryWeight(values=values, scale=1.0 / float(weight_scale.float().reshape(-1)[0]))


def bitnet_packed_from_ternary(ternary: TernaryWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`ternary_from_bitnet`: ``(weight uint8 [ceil(N/4), K], weight_scale [1])``."""
    n, k = ternary.values.shape
    rows = -(-n // 4)
    codes = torch.ones((rows * 4, k), dtype=torch.uint8)
    codes[:n] = (ternary.values.to(torch.int16) + 1).to(torch.uint8)
    packed = torch.zeros((rows, k), dtype=torch.uint8)
    for i in range(4):
        packed |= codes[i * rows : (i + 1) * rows] << (2 * i)
    return packed, torch.tensor([1.0 / ternary.scale])


GGUF_TERNARY_TYPES = ("TQ1_0", "TQ2_0")


def ternary_from_gguf(
    blocks: np.ndarray | torch.Tensor, shape: tuple[int, int], quant_type: str
) -> TernaryBlockWeight:
    """Raw GGUF ``TQ2_0``/``TQ1_0`` bytes of a ``[N, K]`` tensor -> :class:`TernaryBlockWeight`. TQ2_0's
    codes are taken as they are; TQ1_0's (five a byte in base 3) are unpacked into TQ2_0's."""
    if quant_type == "TQ2_0":
        codes, scales = ternary.tq2_from_gguf(blocks, shape)
    elif quant_type == "TQ1_0":
        values, scales = ternary.tq1_values(blocks, shape)
        codes = ternary.pack_tq2(values)
    else:
        raise ValueError(f"unsupported GGUF type {quant_type!r}; expected one of {GGUF_TERNARY_TYPES}")
    return TernaryBlockWeight(codes=codes, block_scales=scales, in_features=shape[1])
