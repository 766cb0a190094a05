"""Rotary position embeddings in Hugging Face's rotate-half layout, with linear and llama3 scaling.

The cos/sin table is built lazily on the device of the first positions it sees, so the module has
no buffers: a model created on the meta device and filled by the loader needs no re-initialisation.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] (float32), computed the way transformers does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default" or scaling is None:
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling {rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's scheme: long wavelengths are slowed by `factor`, short ones kept, the middle blended."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self._cos_sin: torch.Tensor | None = None  # [max_positions, 2, head_dim] float32

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) pair :func:`apply_rotary` takes for the given positions [T]: each [T, 1, head_dim].

        ``sin`` has its first half negated, which folds rotate-half's sign into the table.
        """
        table = self._table(positions.device)
        cos_sin = table[positions]
        return cos_sin[:, 0, None].to(dtype), cos_sin[:, 1, None].to(dtype)

    def _table(self, device: torch.device) -> torch.Tensor:
        if self._cos_sin is None or self._cos_sin.device != device:
            inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
            t = torch.arange(self.max_positions, dtype=torch.float32)
            freqs = t[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            sin = emb.sin()
            sin[:, : self.head_dim // 2] *= -1
            self._cos_sin = torch.stack((emb.cos(), sin), dim=1).to(device)
        return self._cos_sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by the pair from :class:`RotaryEmbedding` (rotate-half convention).

    rotate_half(x) * sin == roll(x, half) * sin with sin's first half negated (exactly: only signs
    move), so this is transformers' ``x * cos + rotate_half(x) * sin`` in four ops instead of six.
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
