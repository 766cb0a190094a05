"""What every linear of the engine shows: its shape, and the format its weight is held in.

``nn.Linear`` has the shape but no format; the engine's own linears (``GgmlLinear``, ``Q4CpuLinear``,
``TernaryCpuLinear``, ``StackedLinear``, ...) have all three. Code that reads a linear it did not build
(the C decoder layer's glue, reports) types it with :class:`Linear` rather than ``nn.Module``, whose
``__getattr__`` makes every attribute ``Tensor | Module`` and so hides a misspelt one from mypy.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Linear(Protocol):
    in_features: int
    out_features: int
    format: str
    """The weight's format: a GGML type name (``q4_0``, ``q8_0``, ``tq2_0``), or ``stacked``."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...
