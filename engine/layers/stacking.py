"""Stack several linears that read the same input into one (q/k/v, gate/up): one GEMM per step
instead of several, each over a wider weight. Used when serving only; see ``fuse_projections``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.layers.ggml_linear import GgmlLinear, stack_ggml_linears
from engine.layers.packed_linear import Q4CpuLinear
from engine.layers.quant.linear import Int4Linear
from engine.layers.quant.weights import Int4Weight
from engine.layers.ternary_linear import TernaryCpuLinear


def stack_linears(parts: Sequence[nn.Module]) -> nn.Module | None:
    """One linear whose output is ``parts``' outputs side by side, or None when they cannot be stacked
    (mixed kinds, biases on some only, different INT4 group sizes or backends)."""
    q4 = [p for p in parts if isinstance(p, Q4CpuLinear)]  # a GGUF's Q4 blocks, laid out at load
    stacked_q4 = Q4CpuLinear.stacked(q4) if len(q4) == len(parts) else None
    if stacked_q4 is not None:
        return stacked_q4
    if q4 or any(isinstance(p, GgmlLinear) for p in parts):
        return stack_ggml_linears(parts, (GgmlLinear, Int4Linear, Q4CpuLinear))
    if len({type(p) for p in parts}) != 1 or len({p.bias is None for p in parts}) != 1:
        return None
    first = parts[0]
    linears = [p for p in parts if type(p) is nn.Linear]
    if len(linears) == len(parts):
        return _stacked_float(linears)
    int4 = [p for p in parts if isinstance(p, Int4Linear)]
    if (
        type(first) is Int4Linear
        and len(int4) == len(parts)
        and len({(p.group_size, p.backend) for p in int4}) == 1
    ):
        return _stacked_int4(int4)
    if type(first) is TernaryCpuLinear:
        return TernaryCpuLinear.stacked(parts)  # type: ignore[arg-type]
    return None


def _stacked_float(parts: Sequence[nn.Linear]) -> nn.Linear:
    first = parts[0]
    stacked = nn.Linear(
        first.in_features,
        sum(p.out_features for p in parts),
        bias=first.bias is not None,
        device=first.weight.device,
        dtype=first.weight.dtype,
    )
    with torch.no_grad():
        stacked.weight.copy_(torch.cat([p.weight for p in parts]))
        if stacked.bias is not None:
            stacked.bias.copy_(torch.cat([p.bias for p in parts if p.bias is not None]))
    return stacked.requires_grad_(False)


def _stacked_int4(parts: Sequence[Int4Linear]) -> Int4Linear:
    first = parts[0]
    weights = [p.int4_weight() for p in parts]
    stacked_weight = Int4Weight(
        codes=torch.cat([w.codes for w in weights]),
        scales=torch.cat([w.scales for w in weights]),
        mins=torch.cat([w.mins for w in weights]),
        group_size=first.group_size,
    )
    biases = [p.bias for p in parts if p.bias is not None]
    bias = torch.cat(biases) if len(biases) == len(parts) else None
    device = stacked_weight.codes.device
    dtype = torch.float32 if bias is None else bias.dtype
    return Int4Linear(stacked_weight, bias, device=device, dtype=dtype, backend=first.backend)
