"""What one model family is, declared: names on disk and the per-layer differences from plain Llama.

Each family module (``llama.py``, ``qwen3.py``, ...) holds one :class:`Family`; the registry
(``engine/families/__init__.py``) lists them. ``ModelConfig`` reads the family to turn a
``config.json`` or a GGUF header into its fields, and the GGUF tensor reader reads it for names and
llama.cpp's q/k permutation. Nothing here imports torch: the config is read before any model exists.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def no_nope_layers(num_layers: int) -> tuple[int, ...]:
    del num_layers
    return ()


def no_hf_nope_layers(config: Mapping[str, Any]) -> tuple[int, ...]:
    del config
    return ()


def no_extras(config: Mapping[str, Any]) -> Mapping[str, Any]:
    del config
    return {}


def no_gguf_extras(
    key: Callable[[str, Any], Any], num_layers: int, tensors: Mapping[str, Sequence[float]]
) -> Mapping[str, Any]:
    del key, num_layers, tensors
    return {}


@dataclass(frozen=True)
class Family:
    hf_architectures: tuple[str, ...]
    """``config.json``'s ``architectures[0]`` values; the first is the name the engine reports."""
    gguf_architecture: str | None
    """GGUF ``general.architecture`` (None: no GGUF form is read)."""
    gguf_qk_permuted: bool = False
    """llama.cpp's converter permuted q/k rows (its ``LlamaModel.permute``) for interleaved-pair rope:
    the reader undoes it. Families it converts with NEOX rope (Qwen) are stored as they are."""
    qkv_bias: Callable[[Mapping[str, Any]], bool] = field(
        default=lambda c: bool(c.get("attention_bias", False))
    )
    """Bias on q/k/v, from ``config.json``."""
    o_bias: Callable[[Mapping[str, Any]], bool] = field(
        default=lambda c: bool(c.get("attention_bias", False))
    )
    """Bias on o_proj, from ``config.json`` (Llama's ``attention_bias`` covers it, Qwen2's qkv bias not)."""
    qk_norm: bool = False
    """A per-head RMSNorm over head_dim on q and on k before rotary (Qwen3)."""
    hf_nope_layers: Callable[[Mapping[str, Any]], tuple[int, ...]] = no_hf_nope_layers
    """Indices of the layers that apply no rotary, from ``config.json``."""
    gguf_nope_layers: Callable[[int], tuple[int, ...]] = no_nope_layers
    """The same for a GGUF of ``num_layers`` layers (llama.cpp fixes them per architecture)."""
    hidden_acts: tuple[str, ...] = ("silu",)
    """MLP activations the engine implements for this family."""
    gguf_layer_tensors: Mapping[str, str] = field(default_factory=dict)
    """Per-layer GGUF tensors beyond Llama's (``attn_q_norm`` -> ``self_attn.q_norm``), or in place of
    them (Gemma 3's ``ffn_norm`` is its pre-feed-forward norm, not Llama's post-attention one)."""
    hf_norm_offset: float = 0.0
    """Added to every ``*norm.weight`` of a Hugging Face checkpoint as it is read: Gemma's RMSNorm
    scales by ``1 + w``; the model holds ``1 + w`` as llama.cpp's converter writes it into a GGUF, so
    one plain RMSNorm (and the C kernels' norms) serve both."""
    hf_extras: Callable[[Mapping[str, Any]], Mapping[str, Any]] = no_extras
    """``ModelConfig`` fields beyond Llama's, from ``config.json`` (sliding window, rope variants)."""
    gguf_extras: Callable[
        [Callable[[str, Any], Any], int, Mapping[str, Sequence[float]]], Mapping[str, Any]
    ] = no_gguf_extras
    """The same from a GGUF header: ``(key(name, default), num_layers, config tensors)`` -> fields;
    ``key`` reads ``<arch>.<name>``, the tensors are the file's ``CONFIG_TENSORS`` by name."""
    model: str = "llama"
    """The model code that computes it (``engine/models/__init__.py``, ``MODEL_CLASSES``): the Llama
    decoder with the differences above, unless the family has its own layers (BitNet)."""
