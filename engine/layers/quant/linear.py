"""``Int4Linear`` and ``TernaryLinear``: drop-in ``nn.Linear`` replacements over packed weights.

Each packs its canonical weight once, at construction, for one backend:

- ``"triton"`` (the default on CUDA): the fused kernels of :mod:`engine.kernels`, in their layouts.
- ``"torch"`` (the default elsewhere): torch's CPU kernels, ``_weight_int4pack_mm_for_cpu`` for
  INT4 (it wants N padded to 16 and K to the group) and ``_int_mm`` (int8 x int8 -> int32) for
  ternary weights, with the same per-token activation quantization as the Triton path.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.int4_matmul import int4_matmul, pack_int4
from engine.kernels.ternary_matmul import pack_ternary, quantize_activations_ref, ternary_matmul
from engine.layers.quant.quantizers import absmean_ternarize, rtn_quantize
from engine.layers.quant.weights import Int4Weight, TernaryWeight

Backend = Literal["triton", "torch"]
_CPU_INT4_N_MULTIPLE = 16
_CPU_INT4_CODE_OFFSET = 8  # torch's CPU int4 kernel computes (code - 8) * scale + zero


def default_backend(device: torch.device | str | None) -> Backend:
    return "triton" if torch.device(device or "cpu").type == "cuda" else "torch"


class Int4Linear(nn.Module):
    """W4A16 linear: group-wise 4-bit weights, activations and output in the model dtype."""

    def __init__(
        self,
        weight: Int4Weight,
        bias: torch.Tensor | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        backend: Backend | None = None,
    ) -> None:
        super().__init__()
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.group_size = weight.group_size
        self.backend: Backend = backend or default_backend(device)
        if self.backend == "triton":
            qweight, scales, mins = pack_int4(weight.codes, weight.scales, weight.mins, weight.group_size)
            self.register_buffer("qweight", qweight.to(device))
            self.register_buffer("scales", scales.to(device))
            self.register_buffer("mins", mins.to(device))
        else:
            packed, scales_and_zeros = _pack_for_cpu(weight, dtype)
            self.register_buffer("packed", packed.to(device))
            self.register_buffer("scales_and_zeros", scales_and_zeros.to(device))
        self.register_buffer("bias", None if bias is None else bias.detach().to(device, dtype))

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group_size: int = 128, backend: Backend | None = None
    ) -> Int4Linear:
        """Round-to-nearest quantization of a float linear (AWQ scales, if any, already folded in)."""
        w = linear.weight
        return cls(rtn_quantize(w, group_size), linear.bias, device=w.device, dtype=w.dtype, backend=backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "triton":
            out = int4_matmul(x, self.qweight, self.scales, self.mins, self.group_size)
        else:
            x2 = x.reshape(-1, self.in_features)
            k_pad = self.scales_and_zeros.shape[0] * self.group_size
            x2 = F.pad(x2, (0, k_pad - self.in_features))
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, self.packed, self.group_size, self.scales_and_zeros.to(x.dtype)
            )
            out = out[:, : self.out_features].reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, backend={self.backend}"
        )


def _pack_for_cpu(weight: Int4Weight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = weight.codes.shape
    num_groups = weight.scales.shape[1]
    n_pad = -(-n // _CPU_INT4_N_MULTIPLE) * _CPU_INT4_N_MULTIPLE
    codes = torch.zeros((n_pad, num_groups * weight.group_size), dtype=torch.int32)
    codes[:n, :k] = weight.codes.to(torch.int32)
    scales = torch.zeros((n_pad, num_groups))
    zeros = torch.zeros((n_pad, num_groups))
    # fp16 scales and mins, as in the Triton layout, so both backends compute with the same weights
    scales[:n] = weight.scales.half().float()
    zeros[:n] = weight.mins.half().float() + _CPU_INT4_CODE_OFFSET * scales[:n]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()
    return packed, scales_and_zeros


class TernaryLinear(nn.Module):
    """BitNet b1.58 linear: ternary weights, int8 per-token absmax activations, output in x.dtype."""

    def __init__(
        self,
        weight: TernaryWeight,
        bias: torch.Tensor | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        backend: Backend | None = None,
    ) -> None:
        super().__init__()
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.backend: Backend = backend or default_backend(device)
        if self.backend == "triton":
            self.register_buffer("qweight", pack_ternary(weight.values).to(device))
        else:  # [K, N] int8, the operand order of torch._int_mm
            self.register_buffer("values_t", weight.values.t().contiguous().to(device))
        self.register_buffer("weight_scale", torch.tensor([weight.scale], dtype=torch.float32, device=device))
        self.register_buffer("bias", None if bias is None else bias.detach().to(device, dtype))

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: Backend | None = None) -> TernaryLinear:
        """Absmean ternarization of a float linear (for experiments: accuracy needs BitNet training)."""
        w = linear.weight
        return cls(absmean_ternarize(w), linear.bias, device=w.device, dtype=w.dtype, backend=backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "triton":
            out = ternary_matmul(x, self.qweight, self.weight_scale)
        else:
            xq, x_scale = quantize_activations_ref(x.reshape(-1, self.in_features))
            acc = torch._int_mm(xq, self.values_t)
            out = (acc.float() / x_scale[:, None] * self.weight_scale).to(x.dtype)
            out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, backend={self.backend}"
