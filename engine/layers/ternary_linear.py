"""``TernaryCpuLinear``: a BitNet b1.58 linear on the ternary C kernel (``engine/cpu/ternary.py``), its
weight at two bits (GGUF TQ2_0's codes) plus a float scale per row or a float16 scale per 256 weights.

It takes the place of a CPU ``TernaryLinear`` (a transformers BitNet checkpoint: one int8 a weight,
run by ``torch._int_mm``) and is what a TQ2_0 / TQ1_0 GGUF's linears load into, without a float or
int8 copy of the whole model. With row scales it computes bit for bit what ``TernaryLinear``'s torch
path does (the same int8 activations, an exact integer dot product, the same float operations); a
row's result does not depend on the batch or the thread count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.cpu import kernels as cpu_kernels
from engine.cpu import ternary
from engine.layers.quant.linear import TernaryLinear
from engine.layers.quant.weights import TernaryWeight


class TernaryCpuLinear(nn.Module):
    format = "tq2_0"

    def __init__(
        self,
        codes: torch.Tensor,
        in_features: int,
        *,
        row_scales: torch.Tensor | None = None,
        block_scales: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> None:
        """``codes`` [N, K rounded up to 256 / 4] from :func:`ternary.pack_tq2` (or a TQ2_0 tensor's
        own); ``row_scales`` [N] float32 or ``block_scales`` [N, K / 256] float16. Block scales that a
        row's blocks share become its row scale (the faster kernel, and the torch path's formula).
        Codes and block scales are held in the kernel's layout (:func:`ternary.kernel_layout`)."""
        super().__init__()
        if block_scales is not None and (shared := ternary.shared_scale(block_scales)) is not None:
            row_scales, block_scales = shared, None
        self.in_features, self.out_features = in_features, codes.shape[0]
        self.codes, self.block_scales = ternary.kernel_layout(
            codes, None if block_scales is None else block_scales.half()
        )
        self.row_scales = None if row_scales is None else row_scales.float().contiguous()
        self.bias = None if bias is None else bias.detach().float()

    @property
    def qweight(self) -> torch.Tensor:
        """The codes, under the name the C decoder layer reads every linear's weight by."""
        return self.codes

    def natural_codes(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The codes and block scales in row order (:func:`ternary.pack_tq2`'s)."""
        return ternary.natural_layout(self.codes, self.block_scales)

    @property
    def scales(self) -> torch.Tensor | None:
        """The block scales (None with row scales), under the C decoder layer's name."""
        return self.block_scales

    @classmethod
    def from_ternary(cls, weight: TernaryWeight, bias: torch.Tensor | None = None) -> TernaryCpuLinear:
        row_scales = torch.full((weight.out_features,), weight.scale, dtype=torch.float32)
        return cls(ternary.pack_tq2(weight.values), weight.in_features, row_scales=row_scales, bias=bias)

    @classmethod
    def from_linear(cls, linear: TernaryLinear) -> TernaryCpuLinear:
        """The same weight as a CPU ``TernaryLinear`` (torch backend), at a quarter of its bytes."""
        values_t, weight_scale, bias = linear.values_t, linear.weight_scale, linear.bias
        assert isinstance(values_t, torch.Tensor) and isinstance(weight_scale, torch.Tensor)
        assert bias is None or isinstance(bias, torch.Tensor)
        scales = weight_scale.expand(linear.out_features)
        return cls(ternary.pack_tq2(values_t.t()), linear.in_features, row_scales=scales, bias=bias)

    @staticmethod
    def supports(linear: nn.Module) -> bool:
        return (
            isinstance(linear, TernaryLinear)
            and linear.backend == "torch"
            and linear.values_t.device.type == "cpu"
            and cpu_kernels.available()
        )

    @classmethod
    def stacked(cls, parts: Sequence[TernaryCpuLinear]) -> TernaryCpuLinear | None:
        """One linear whose output is ``parts``' outputs side by side (q/k/v, gate/up), or None where
        they cannot be stacked (row scales on some, block scales on others; biases on some)."""
        if len({p.row_scales is None for p in parts}) != 1 or len({p.bias is None for p in parts}) != 1:
            return None
        if len({p.in_features for p in parts}) != 1:
            return None
        first = parts[0]

        def cat(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
            return None if tensors[0] is None else torch.cat(tensors)  # type: ignore[arg-type]

        natural = [p.natural_codes() for p in parts]
        return cls(
            torch.cat([codes for codes, _ in natural]),
            first.in_features,
            row_scales=cat([p.row_scales for p in parts]),
            block_scales=cat([scales for _, scales in natural]),
            bias=cat([p.bias for p in parts]),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = ternary.matmul_tq2_laid_out(
            rows if rows.dtype == torch.float32 else rows.float(),
            self.codes,
            row_scales=self.row_scales,
            block_scales=self.block_scales,
        )
        out = out.to(x.dtype)
        if self.bias is not None:  # in x's dtype, as TernaryLinear adds it
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """[N, K] float32: what the codes and scales stand for (for tests and checks, not serving)."""
        codes, block_scales = self.natural_codes()
        values = ternary.unpack_tq2(codes, codes.shape[1] * 4).float()
        if self.row_scales is not None:
            weight = values * self.row_scales[:, None]
        else:
            assert block_scales is not None
            blocks = values.reshape(self.out_features, -1, ternary.QK) * block_scales.float()[..., None]
            weight = blocks.reshape(self.out_features, -1)
        return weight[:, : self.in_features]

    def bits_per_weight(self) -> float:
        """What the weight takes in memory: codes and scales over the layer's weights."""
        scales = self.row_scales if self.row_scales is not None else self.block_scales
        held = self.codes.numel() + scales.numel() * scales.element_size()  # type: ignore[union-attr]
        return 8 * held / (self.in_features * self.out_features)

    def extra_repr(self) -> str:
        scales = "row" if self.row_scales is not None else "block"
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, format={self.format}, scales={scales}"


class FromTernaryLinear:
    """The linear factory's row for a ``TernaryLinear`` (engine/loader/linear_factory.py): a module
    class's interface, ``supports(module)`` and ``(module) -> TernaryCpuLinear``."""

    supports = staticmethod(TernaryCpuLinear.supports)

    def __call__(self, module: nn.Module) -> TernaryCpuLinear:
        assert isinstance(module, TernaryLinear)
        return TernaryCpuLinear.from_linear(module)


FROM_TERNARY_LINEAR = FromTernaryLinear()
