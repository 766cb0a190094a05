"""Round-to-nearest INT4 (group-wise, asymmetric) and absmean (BitNet ternary) quantizers.

AWQ (:mod:`engine.layers.quant.awq`) rescales and clips weights, then quantizes them with RTN.
"""

from __future__ import annotations

import torch

from engine.layers.quant.weights import Int4Weight, TernaryWeight

INT4_MAX_CODE = 15


def _rtn_groups(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scales and integer zero points of weight groups ``[..., G]`` (AutoAWQ's formula)."""
    # The range always spans 0 (as in GPTQ), so the integer zero point never needs clamping.
    lo = groups.amin(dim=-1).clamp(max=0)
    hi = groups.amax(dim=-1).clamp(min=0)
    scales = (hi - lo).clamp(min=1e-5) / INT4_MAX_CODE
    zeros = (-torch.round(lo / scales)).clamp(0, INT4_MAX_CODE)
    codes = (torch.round(groups / scales[..., None]) + zeros[..., None]).clamp(0, INT4_MAX_CODE)
    return codes, scales, zeros


def pad_to_groups(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """``weight [N, K]`` as float ``[N, G, group_size]``; a ragged last group is padded with copies
    of its first column, which leaves its range unchanged."""
    n, k = weight.shape
    num_groups = -(-k // group_size)
    w = weight.detach().float()
    if k % group_size:
        first = w[:, (num_groups - 1) * group_size : (num_groups - 1) * group_size + 1]
        w = torch.cat([w, first.expand(n, num_groups * group_size - k)], dim=1)
    return w.reshape(n, num_groups, group_size)


def rtn_quantize(weight: torch.Tensor, group_size: int) -> Int4Weight:
    """Round-to-nearest, asymmetric, with an integer zero point per group."""
    n, k = weight.shape
    codes, scales, zeros = _rtn_groups(pad_to_groups(weight, group_size))
    return Int4Weight(
        codes=codes.reshape(n, -1)[:, :k].to(torch.uint8).contiguous(),
        scales=scales,
        mins=-zeros * scales,
        group_size=group_size,
    )


def rtn_fake_quantize(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """``rtn_quantize(weight).dequantize()`` in ``weight``'s dtype, without building the
    ``Int4Weight``: the inner loop of the AWQ searches."""
    n, k = weight.shape
    codes, scales, zeros = _rtn_groups(pad_to_groups(weight, group_size))
    dequantized = codes * scales[..., None] + (-zeros * scales)[..., None]
    return dequantized.reshape(n, -1)[:, :k].to(weight.dtype)


def absmean_ternarize(weight: torch.Tensor) -> TernaryWeight:
    """BitNet b1.58's weight quantizer: ``round(W / mean|W|)`` clipped to {-1, 0, 1}."""
    w = weight.detach().float()
    scale = w.abs().mean().clamp(min=1e-5)
    return TernaryWeight(values=(w / scale).round().clamp(-1, 1).to(torch.int8), scale=float(scale))
