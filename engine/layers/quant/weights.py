"""Canonical, layout-free forms of quantized weights: every converter produces one of these."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Int4Weight:
    """Group-wise asymmetric 4-bit weight in ``nn.Linear`` orientation: ``w = code * scale + min``.

    ``codes`` is uint8 ``[N, K]`` with values 0..15; ``scales``/``mins`` are fp32 ``[N, ceil(K/G)]``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    group_size: int

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        groups = (n, -(-k // self.group_size))
        if tuple(self.scales.shape) != groups or tuple(self.mins.shape) != groups:
            raise ValueError(f"scales/mins must be {groups} for codes {(n, k)} and group {self.group_size}")

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[N, K]``: what the quantized weight stands for."""
        k = self.in_features
        scale = self.scales.float().repeat_interleave(self.group_size, dim=1)[:, :k]
        minimum = self.mins.float().repeat_interleave(self.group_size, dim=1)[:, :k]
        return self.codes.float() * scale + minimum


@dataclass(frozen=True)
class TernaryWeight:
    """BitNet b1.58 weight: int8 ``values`` in {-1, 0, 1}, ``[N, K]``, and ``w ~= values * scale``."""

    values: torch.Tensor
    scale: float

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    @property
    def in_features(self) -> int:
        return self.values.shape[1]

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scale


@dataclass(frozen=True)
class TernaryBlockWeight:
    """Ternary weight as GGUF's TQ2_0 holds it: ``codes`` uint8 ``[N, K / 4]`` (``T + 1`` in two bits,
    in TQ2_0's order: see ``engine/cpu/ternary.py``) and one float16 scale per block of 256,
    ``block_scales`` ``[N, K / 256]``; ``w = T * scale``. TQ1_0 files load into it too."""

    codes: torch.Tensor
    block_scales: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]
