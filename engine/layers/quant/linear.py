"""``Int4Linear`` and ``TernaryLinear``: drop-in ``nn.Linear`` replacements over packed weights.

Each packs its canonical weight once, at construction, for one backend:

- ``"triton"`` (the default on CUDA): the fused kernels of :mod:`engine.kernels`, in their layouts.
- ``"torch"`` (the default elsewhere): INT4 layers dequantize their weight per call (one byte per
  code, fp16 scales and mins) and run a dense matmul; torch's ``_weight_int4pack_mm_for_cpu`` was
  measured slower here in float32 (its cost grows with the batch) and rounds through bf16. Ternary
  layers use ``_int_mm`` (int8 x int8 -> int32), with the Triton path's per-token quantization.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.quant.quantizers import absmean_ternarize, rtn_quantize
from engine.layers.quant.weights import Int4Weight, TernaryWeight

Backend = Literal["triton", "torch"]

# The Triton kernels are imported where a layer uses them: importing Triton costs about 80 MB of
# resident memory, which a CPU process serving the torch backend does not need.


def default_backend(device: torch.device | str | None) -> Backend:
    return "triton" if torch.device(device or "cpu").type == "cuda" else "torch"


class Int4Linear(nn.Module):
    """W4A16 linear: group-wise 4-bit weights, activations and output in the model dtype."""

    # Buffers, registered in __init__ (the ones of the layer's backend); declared for the type checker.
    qweight: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    bias: torch.Tensor | None

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
            from engine.kernels.int4_matmul import pack_int4

            qweight, scales, mins = pack_int4(weight.codes, weight.scales, weight.mins, weight.group_size)
            self.register_buffer("qweight", qweight.to(device))
            self.register_buffer("scales", scales.to(device))
            self.register_buffer("mins", mins.to(device))
        else:
            k_pad = weight.scales.shape[1] * weight.group_size
            codes = weight.codes  # taken as it is where no padding is needed: no second copy while loading
            if k_pad != weight.in_features or codes.dtype != torch.uint8 or not codes.is_contiguous():
                codes = torch.zeros((weight.out_features, k_pad), dtype=torch.uint8)
                codes[:, : weight.in_features] = weight.codes
            self.register_buffer("codes", codes.to(device))
            self.register_buffer("scales", weight.scales.half().to(device))
            self.register_buffer("mins", weight.mins.half().to(device))
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
            from engine.kernels.int4_matmul import int4_matmul

            out = int4_matmul(x, self.qweight, self.scales, self.mins, self.group_size)
        else:
            out = F.linear(x, self.dequantized_weight(x.dtype))
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def int4_weight(self) -> Int4Weight:
        """The canonical weight this layer holds (scales and mins as stored, in fp16 precision),
        on the layer's device: what a quantized checkpoint writes."""
        if self.backend == "triton":
            from engine.kernels.int4_matmul import unpack_int4_codes

            codes = unpack_int4_codes(self.qweight)[: self.in_features].t()
            scales, mins = self.scales.t(), self.mins.t()
        else:
            codes, scales, mins = self.codes[:, : self.in_features], self.scales, self.mins
        return Int4Weight(
            codes=codes.contiguous(),
            scales=scales.float().contiguous(),
            mins=mins.float().contiguous(),
            group_size=self.group_size,
        )

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """``[N, K]`` in ``dtype`` (torch backend): ``code * scale + min`` per group."""
        n, k_pad = self.codes.shape
        groups = self.codes.view(n, -1, self.group_size).to(dtype)
        weight = groups * self.scales.to(dtype)[..., None] + self.mins.to(dtype)[..., None]
        return weight.view(n, k_pad)[:, : self.in_features]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, backend={self.backend}"
        )


class TernaryLinear(nn.Module):
    """BitNet b1.58 linear: ternary weights, int8 per-token absmax activations, output in x.dtype."""

    # Buffers, registered in __init__; declared for the type checker.
    qweight: torch.Tensor
    values_t: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

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
            from engine.kernels.ternary_matmul import pack_ternary

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
        from engine.kernels.ternary_matmul import quantize_activations_ref, ternary_matmul

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
