"""``MklPackedLinear``: a float32 CPU ``nn.Linear`` that also holds its weight in MKL's packed layout.

MKL's ``sgemm`` re-packs the weight matrix on every call. With the few rows of a decode step that
packing costs more than the arithmetic: on the development CPU a 16-row linear of SmolLM2's shapes
ran 1.6 to 2.5 times faster with a weight packed once, at load (docs/engine.md, "CPU linears").
MKL's packed GEMM serves one row count, so batches of ``MIN_PACKED_ROWS`` to ``PACKED_ROWS`` rows are
padded to ``PACKED_ROWS`` and take it. Smaller ones keep ``F.linear`` (MKL's matrix-vector path is
faster there), and so do larger ones (prefill), whose packing cost is spread over many rows.

The price is a second copy of every weight, so ``LLMEngine.from_config`` packs only models it loaded
itself, on CPU in float32 (``EngineConfig.pack_cpu_linears``, ``tern engine --no-pack-cpu-linears``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKED_ROWS = 16
MIN_PACKED_ROWS = 6
"""From 6 rows up, padding to 16 and the packed GEMM beat ``F.linear`` on every shape measured."""


def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


class MklPackedLinear(nn.Module):
    """Drop-in for a float32 CPU ``nn.Linear``; shares the original's weight and bias tensors."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        with torch.no_grad():
            self.packed_weight = torch.ops.mkl._mkl_reorder_linear_weight(linear.weight.detach(), PACKED_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        m = rows.shape[0]
        if not MIN_PACKED_ROWS <= m <= PACKED_ROWS:
            return F.linear(x, self.weight, self.bias)
        if m < PACKED_ROWS:
            rows = F.pad(rows, (0, 0, 0, PACKED_ROWS - m))
        out = torch.ops.mkl._mkl_linear(rows, self.packed_weight, self.weight, self.bias, PACKED_ROWS)
        return out[:m].reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed_rows={PACKED_ROWS}"


def pack_cpu_linears(model: nn.Module) -> int:
    """Replace every float32 CPU ``nn.Linear`` of ``model`` by an ``MklPackedLinear``, in place.
    Returns how many were replaced (0 where MKL's packed GEMM is not available)."""
    if not mkl_packing_available():
        return 0
    names = [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
    ]
    for name in names:
        model.set_submodule(name, MklPackedLinear(model.get_submodule(name)))
    return len(names)
