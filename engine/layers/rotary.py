"""Rotary position embeddings in Hugging Face's rotate-half layout, with linear, llama3, YaRN and
LongRoPE scaling, a GGUF's per-pair ``rope_freqs`` divisors (llama.cpp's form of llama3 scaling), and
partial rotary (a table narrower than the head turns its leading dims).

The cos/sin table is built lazily on the device of the first positions it sees, so the module has
no buffers: a model created on the meta device and filled by the loader needs no re-initialisation.
It holds the positions the engine runs (:func:`fit_rotary_tables`: its max model length), not every
one the model could (Gemma-3-1B's 32k positions are 128 MB of tables, two rope bases); each row is
computed on its own, so a shorter table's rows are the longer one's. On the CPU a table also grows
with the furthest position run so far (doubling, from :data:`MIN_TABLE_ROWS`), up to that length:
a served Gemma-3-1B at its default 32k max model length held both 64 MB tables from its first
request, resident, however short its sequences.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.layers.context import get_context

MIN_TABLE_ROWS = 1024
"""Rows a CPU table starts with (2 MB for a 256-wide head); it doubles as positions run further."""


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
    if rope_type == "longrope":
        return _longrope_inv_freq(head_dim, theta, scaling, long=False)
    raise ValueError(f"unsupported rope scaling {rope_type!r}")


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (transformers' default
    ``0.1 ln(factor) + 1``), LongRoPE's (filled in by its family), else 1."""
    if (scaling or {}).get("rope_type") == "longrope":
        return float(scaling["attention_factor"])  # type: ignore[index]
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


def _longrope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any], long: bool) -> torch.Tensor:
    """LongRoPE (Phi-3) as transformers computes it: each pair's frequency divided by its factor."""
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (factors * theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def longrope_rows(positions: torch.Tensor, original: int) -> torch.Tensor:
    """[T] bool: which tokens take LongRoPE's long factors. transformers picks them per forward, by its
    largest position: a whole prompt, then one token at a time. Here per sequence of the step, by how
    far that forward reaches (``Context.rope_reach_host``: the prompt's end while it is prefilled, in
    however many chunks, else the context) past ``original``. Without a context the batch is one
    sequence."""
    ctx = get_context()
    if ctx.num_seqs == 0:
        return torch.full_like(positions, int(positions.max()) + 1 > original, dtype=torch.bool)
    flags = [n > original for n in (ctx.rope_reach_host or ctx.context_lens_host)]
    if not any(flags):
        return torch.zeros_like(positions, dtype=torch.bool)
    rows = [flag for flag, n in zip(flags, ctx.query_lens_host, strict=True) for _ in range(n)]
    return torch.tensor(rows, device=positions.device)


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
        self.table_positions = max_positions
        """Rows the tables may hold (:meth:`fit`): the positions the engine will run. On a GPU they hold
        them all (CUDA graphs keep the tables' addresses); on the CPU as many as run so far."""
        self._cos_sin: torch.Tensor | None = None  # [rows, 2, head_dim] float32
        self._long_cos_sin: torch.Tensor | None = None  # LongRoPE's long factors' table
        self.longrope_original = (
            int(scaling["original_max_position_embeddings"])
            if (scaling or {}).get("rope_type") == "longrope" and scaling is not None
            else None
        )
        """LongRoPE's original context: sequences past it take the long factors (None: no LongRoPE)."""

    def fit(self, positions: int) -> None:
        """Hold rows for positions 0 .. ``positions`` - 1 (at most the model's); tables rebuilt lazily."""
        rows = min(self.max_positions, positions)
        if rows != self.table_positions:
            self.table_positions = rows
            self._cos_sin = self._long_cos_sin = None

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) pair :func:`apply_rotary` takes for the given positions [T]: each [T, 1, head_dim].

        ``sin`` has its first half negated, which folds rotate-half's sign into the table.
        """
        rows = self._rows_for(positions)
        cos_sin = _rows(self._table(positions.device, rows), positions)
        if self.longrope_original is not None:
            long = longrope_rows(positions, self.longrope_original)
            if bool(long.any()):
                cos_sin = torch.where(
                    long[:, None, None], _rows(self._table(positions.device, rows, True), positions), cos_sin
                )
        return cos_sin[:, 0, None].to(dtype), cos_sin[:, 1, None].to(dtype)

    def _rows_for(self, positions: torch.Tensor) -> int:
        """Rows the table needs for ``positions``: on the CPU the next power of two past the furthest
        (at least :data:`MIN_TABLE_ROWS`), within the fitted length; elsewhere the fitted length (no
        read of a device tensor, no table that moves under a captured graph)."""
        if positions.device.type != "cpu" or positions.numel() == 0:
            return self.table_positions
        furthest = int(positions.max()) + 1
        return min(self.table_positions, max(MIN_TABLE_ROWS, 1 << (furthest - 1).bit_length()))

    def _table(self, device: torch.device, rows: int, long: bool = False) -> torch.Tensor:
        """The cos/sin table (LongRoPE's long factors' with ``long``) with at least ``rows`` rows."""
        table = self._long_cos_sin if long else self._cos_sin
        if table is not None and table.device == device and table.shape[0] >= rows:
            return table
        if long:
            assert self.scaling is not None
            inv_freq = _longrope_inv_freq(self.head_dim, self.theta, self.scaling, long=True)
        else:
            inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
            if self.freq_factors is not None:
                inv_freq = inv_freq / torch.tensor(self.freq_factors, dtype=torch.float32)
        table = self._cos_sin_table(inv_freq, rows).to(device)
        if long:
            self._long_cos_sin = table
        else:
            self._cos_sin = table
        return table

    def _cos_sin_table(self, inv_freq: torch.Tensor, rows: int) -> torch.Tensor:
        t = torch.arange(rows, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # YaRN and LongRoPE scale both (transformers' attention_scaling); a factor of 1 changes nothing.
        factor = rope_attention_factor(self.scaling)
        cos, sin = emb.cos() * factor, emb.sin() * factor
        sin[:, : self.head_dim // 2] *= -1
        return torch.stack((cos, sin), dim=1)


def _rows(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``table[positions]`` by ``index_select``, the same copy: on the CPU, indexing by a tensor of
    positions took milliseconds a step on a loaded machine (a parallel region; ``index_select`` stays
    on one thread: microseconds)."""
    return table.index_select(0, positions.reshape(-1)).reshape(*positions.shape, *table.shape[1:])


def fit_rotary_tables(model: nn.Module, positions: int) -> None:
    """Size every rotary table of ``model`` to ``positions`` rows (the engine's longest sequence or
    prefill step). Before CUDA graphs are captured: they keep the tables' addresses."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.fit(positions)


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
