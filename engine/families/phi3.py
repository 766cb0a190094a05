"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama with q/k/v and gate/up stored fused (``qkv_proj``,
``gate_up_proj``; GGUF ``attn_qkv`` and ``ffn_up``), LongRoPE, and rotary over the leading
``partial_rotary_factor`` of each head (Phi-4-mini: 0.75).

LongRoPE divides each pair's frequency by its short factor, or by its long one once a sequence runs
past ``original_max_position_embeddings``: transformers picks them per forward by the largest position
it holds, so a sequence's tokens take the long factors in every step whose context passes that length
(``engine/layers/rotary.py``, ``longrope_rows``; llama.cpp instead picks once by the context size it
was started with). cos and sin are scaled by ``sqrt(1 + ln(factor) / ln(original))`` with ``factor``
the context's growth (``max_position_embeddings / original``) unless the config gives one.
A GGUF holds the factors as the ``rope_factors_long``/``rope_factors_short`` tensors, the rotary dims
as ``rope.dimension_count`` and the original context as ``rope.scaling.original_context_length``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.families.spec import Family


def longrope_scaling(
    short: Sequence[float],
    long: Sequence[float],
    original: int,
    max_positions: int,
    factor: float | None = None,
    attention_factor: float | None = None,
) -> dict[str, Any]:
    """The rope_scaling dict the rotary code reads, with transformers' defaults filled in."""
    factor = factor or max_positions / original
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {
        "rope_type": "longrope",
        "short_factor": tuple(map(float, short)),
        "long_factor": tuple(map(float, long)),
        "original_max_position_embeddings": int(original),
        "attention_factor": float(attention_factor),
    }


def hf_extras(config: Mapping[str, Any]) -> Mapping[str, Any]:
    params = {**dict(config.get("rope_scaling") or {}), **dict(config.get("rope_parameters") or {})}
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    extras: dict[str, Any] = {"rotary_dim": int(head_dim * partial)}
    if params.get("rope_type", params.get("type")) in ("longrope", "su"):
        original = (
            params.get("original_max_position_embeddings") or config["original_max_position_embeddings"]
        )
        extras["rope_scaling"] = longrope_scaling(
            params["short_factor"],
            params["long_factor"],
            original,
            config["max_position_embeddings"],
            params.get("factor"),
            params.get("attention_factor"),
        )
    return extras


def gguf_extras(
    key: Callable[[str, Any], Any], num_layers: int, tensors: Mapping[str, Sequence[float]]
) -> Mapping[str, Any]:
    del num_layers
    head_dim = key("embedding_length", None) // key("attention.head_count", None)
    extras: dict[str, Any] = {"head_dim": head_dim, "rotary_dim": key("rope.dimension_count", head_dim)}
    if "rope_factors_long.weight" in tensors:
        extras["rope_scaling"] = longrope_scaling(
            tensors["rope_factors_short.weight"],
            tensors["rope_factors_long.weight"],
            key("rope.scaling.original_context_length", None),
            key("context_length", None),
            attention_factor=key("rope.scaling.attn_factor", None),
        )
    return extras


FAMILY = Family(
    hf_architectures=("Phi3ForCausalLM",),
    gguf_architecture="phi3",
    gguf_layer_tensors={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    hf_extras=hf_extras,
    gguf_extras=gguf_extras,
    model="phi3",
)
