"""The gated activations of Llama-family MLPs: SiLU (Llama), tanh GELU (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu import kernels as cpu_kernels


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_kernel = False
        """Set on the float32 CPU fast path as the model is built (``engine/loader/build_plan.py``): the
        C kernel, which the C decoder layer calls too, so both paths round alike."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.c_kernel and gate.dtype == torch.float32:
            return cpu_kernels.silu_mul(gate, up)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """Gemma's GeGLU: tanh-approximated GELU of the gate times up (transformers' ``gelu_pytorch_tanh``)."""

    def __init__(self) -> None:
        super().__init__()
        self.c_kernel = False
        """Set on the float32 CPU fast path, as :class:`SiluAndMul`'s: the C kernel, which the C decoder
        layer calls too."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.c_kernel and gate.dtype == torch.float32:
            return cpu_kernels.gelu_tanh_mul(gate, up)
        return F.gelu(gate, approximate="tanh") * up


def gated_activation(hidden_act: str) -> nn.Module:
    """The MLP's gated activation for a config's ``hidden_act``."""
    if hidden_act == "gelu_pytorch_tanh":
        return GeluTanhAndMul()
    return SiluAndMul()
