"""RMSNorm, computed in float32 like transformers so half-precision runs stay close to the reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu import kernels as cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.c_kernel = False
        """Set on the float32 CPU fast path as the model is built (``engine/loader/build_plan.py``): one
        C call instead of seven ops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.c_kernel and x.dtype == torch.float32:
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.bfloat16:
            # A float32 residual stream feeding bf16 layers (the CPU fast path): normalise in float32,
            # round once.
            scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return (x * scale).to(torch.bfloat16) * self.weight
        if x.dtype == self.weight.dtype:
            # One fused op instead of seven. In float32 the same arithmetic as the path below; in
            # bfloat16 (the CPU fast path) it rounds once where that path rounds twice.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)
