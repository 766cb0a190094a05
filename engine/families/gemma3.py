"""Gemma 3 (text): Llama with sandwich norms, GeGLU, per-head q/k norm, scaled embeddings and
sliding-window layers.

- Embeddings are multiplied by sqrt(hidden); every RMSNorm scales by ``1 + w`` (``hf_norm_offset``:
  the model holds ``1 + w``, as llama.cpp's converter writes it); norms before *and* after attention
  and the MLP (``pre_feedforward_layernorm`` is GGUF's ``ffn_norm``, ``post_attention_layernorm``
  its ``post_attention_norm``); the MLP is GeGLU with tanh GELU.
- The query scale is ``query_pre_attn_scalar ** -0.5``; llama.cpp fixes it at ``head_dim ** -0.5``
  (``hidden / heads`` for the 62-layer 27B), as Google's configs have it.
- Local layers attend to the last ``sliding_window`` positions with their own rope base
  (``rope_local_base_freq``, no scaling); every ``sliding_window_pattern``-th layer is global
  (transformers lists them in ``layer_types``; llama.cpp reads ``attention.sliding_window_pattern``
  where a file has it, else 6, and ``rope.freq_base_swa``, else 10000).
- Logits are soft-capped (``tanh(x / c) * c``) where the config has ``final_logit_softcapping``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.families.spec import Family

GGUF_PATTERN = 6
GGUF_LOCAL_THETA = 10000.0
_GGUF_27B_LAYERS = 62


def _sliding_layers(config: Mapping[str, Any]) -> tuple[int, ...]:
    layers = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:
        pattern = (
            config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or GGUF_PATTERN
        )
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")


def _hf_rope(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(global theta, global scaling, local theta) from transformers 5's per-layer-type
    ``rope_parameters`` or the older ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``."""
    params = config.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    theta = float(full.pop("rope_theta", config.get("rope_theta", 1_000_000.0)))
    local_theta = float(local.get("rope_theta", config.get("rope_local_base_freq", GGUF_LOCAL_THETA)))
    scaling = {**full, **dict(config.get("rope_scaling") or {})}
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    scaling.pop("type", None)
    return theta, None if rope_type == "default" else {"rope_type": rope_type, **scaling}, local_theta


def hf_extras(config: Mapping[str, Any]) -> Mapping[str, Any]:
    if config.get("attn_logit_softcapping"):  # Gemma 2's; Gemma 3 has none (llama.cpp asserts as much)
        raise ValueError("attn_logit_softcapping is not supported (Gemma 3 configs have none)")
    theta, scaling, local_theta = _hf_rope(config)
    window = config.get("sliding_window")
    softcap = config.get("final_logit_softcapping")
    return {
        "hidden_act": config.get("hidden_activation", "gelu_pytorch_tanh"),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_local_theta": local_theta,
        "sliding_window": window,
        "sliding_layers": _sliding_layers(config) if window else (),
        "attention_scale": float(config.get("query_pre_attn_scalar", 256)) ** -0.5,
        "embedding_scale": math.sqrt(config["hidden_size"]),
        "final_logit_softcap": float(softcap) if softcap else None,
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", True)),
        "max_position_embeddings": config.get("max_position_embeddings", 131072),
        "head_dim": config.get("head_dim", 256),
    }


def gguf_extras(
    key: Callable[[str, Any], Any], num_layers: int, tensors: Mapping[str, Sequence[float]]
) -> Mapping[str, Any]:
    del tensors
    window = key("attention.sliding_window", None)
    pattern = key("attention.sliding_window_pattern", GGUF_PATTERN)
    if isinstance(pattern, list):  # one flag per layer
        sliding = tuple(i for i, flag in enumerate(pattern) if flag)
    else:
        sliding = tuple(i for i in range(num_layers) if i % pattern < pattern - 1)
    hidden, heads = key("embedding_length", None), key("attention.head_count", None)
    head_dim = key("attention.key_length", None) or hidden // heads
    scale_dim = hidden // heads if num_layers == _GGUF_27B_LAYERS else head_dim
    softcap = key("final_logit_softcapping", None)
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "rope_local_theta": float(key("rope.freq_base_swa", GGUF_LOCAL_THETA)),
        "sliding_window": window or None,
        "sliding_layers": sliding if window else (),
        "attention_scale": float(scale_dim) ** -0.5,
        "embedding_scale": math.sqrt(hidden),
        "final_logit_softcap": float(softcap) if softcap else None,
    }


FAMILY = Family(
    hf_architectures=("Gemma3ForCausalLM",),
    gguf_architecture="gemma3",
    qk_norm=True,
    hidden_acts=("gelu_pytorch_tanh",),
    gguf_layer_tensors={
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    hf_norm_offset=1.0,
    hf_extras=hf_extras,
    gguf_extras=gguf_extras,
    model="gemma3",
)
