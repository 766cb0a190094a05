"""The gated activation of Llama-family MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu import kernels as cpu_kernels


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_kernel = False
        """Set on the float32 CPU fast path (``engine/loader/linear_factory.py``): the C kernel, which
        the C decoder layer calls too, so both paths round alike."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.c_kernel and gate.dtype == torch.float32:
            return cpu_kernels.silu_mul(gate, up)
        return F.silu(gate) * up
