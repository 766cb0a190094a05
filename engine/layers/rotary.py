"""Rotary position embeddings in Hugging Face's rotate-half layout, with linear, llama3 and YaRN
scaling, and a GGUF's per-pair ``rope_freqs`` divisors (llama.cpp's form of llama3 scaling).

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
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"unsupported rope scaling {rope_type!r}")


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (transformers' default
    ``0.1 ln(factor) + 1``), else 1."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (arXiv 2309.00071) as transformers computes it: pairs that turn fewer than ``beta_slow``
    times over the original context are interpolated by ``factor``, more than ``beta_fast`` times
    kept, a linear ramp between."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


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
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        freq_factors: tuple[float, ...] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.freq_factors = freq_factors
        """A GGUF's ``rope_freqs``: each pair's inverse frequency divided by its factor (llama.cpp)."""
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
            if self.freq_factors is not None:
                inv_freq = inv_freq / torch.tensor(self.freq_factors, dtype=torch.float32)
            t = torch.arange(self.max_positions, dtype=torch.float32)
            freqs = t[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            # YaRN scales both (transformers' attention_scaling); a factor of 1 changes nothing.
            factor = rope_attention_factor(self.scaling)
            cos, sin = emb.cos() * factor, emb.sin() * factor
            sin[:, : self.head_dim // 2] *= -1
            self._cos_sin = torch.stack((cos, sin), dim=1).to(device)
        return self._cos_sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by the pair from :class:`RotaryEmbedding` (rotate-half convention).

    rotate_half(x) * sin == roll(x, half) * sin with sin's first half negated (exactly: only signs
    move), so this is transformers' ``x * cos + rotate_half(x) * sin`` in four ops instead of six.
    A table narrower than the head (partial rotary, Phi-3) turns the head's leading dims only.
    """
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    return x * cos + x.roll(dim // 2, -1) * sin
