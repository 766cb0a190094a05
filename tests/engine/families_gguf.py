"""Llama 3.x, Qwen3, SmolLM3 and Gemma 3 as GGUF files, written with the tensor names, permutations and
metadata that llama.cpp's converter (``convert_hf_to_gguf.py``, ``conversion/llama.py``, ``qwen.py``
and ``gemma.py``) uses:

- every family: the Llama keys, ``attention.key_length``/``value_length`` from ``head_dim``;
- Llama (3.1 rope scaling): q/k rows permuted, and a ``rope_freqs`` tensor of per-pair divisors
  (``LlamaModel.generate_extra_tensors``), no ``rope.scaling`` keys;
- Qwen3: ``blk.N.attn_q_norm`` / ``attn_k_norm``, q/k as they are (NEOX rope);
- SmolLM3: Llama's converter (q/k permuted), YaRN as ``rope.scaling.type/factor/original_context_length``
  (and beta keys when the config has them); its NoPE layers are no key (llama.cpp fixes every 4th);
- Gemma 3: every norm written as ``1 + w``, four norms a layer (``post_attention_norm``, ``ffn_norm``
  before the MLP, ``post_ffw_norm``), ``sliding_window``, ``rope.freq_base_swa``,
  ``final_logit_softcapping``; no pattern key (llama.cpp's default: every 6th layer global).

Weights come from a random-weight transformers model of the family's config (few layers), in float32
or quantized by ``gguf.quants`` where it can.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from tests.engine.conftest import TINY_COMMON, TINY_VARIANTS, randomize_norms
from tests.engine.test_loader_gguf import (
    BYTE_TOKENS,
    HF_TO_GGUF,
    add_byte_tokenizer,
    gguf_name,
    llama_cpp_permute,
)

Q = gguf.GGMLQuantizationType
# GGUF architecture -> (the tiny HF variant in conftest, whether llama.cpp permutes its q/k rows).
FAMILY_VARIANTS = {
    "llama": ("llama3", True),
    "qwen3": ("qwen3", False),
    "smollm3": ("smollm3", True),
    "gemma3": ("gemma3", False),
    "phi3": ("phi3", False),
}
_EXTRA_NAMES = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
# Gemma 3's four norms a layer (``gguf-py``'s tensor map): its pre-MLP norm is GGUF's ffn_norm.
_GEMMA3_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_FAMILY_NAMES = {
    "gemma3": _GEMMA3_NAMES,
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}


def tiny_family_model(architecture: str, layers: int | None = None, vocab_size: int | None = None) -> Any:
    """The family's tiny transformers model over the byte vocabulary, or one of ``vocab_size`` (seeded)."""
    import transformers

    config_class, overrides = TINY_VARIANTS[FAMILY_VARIANTS[architecture][0]]
    fields = {**TINY_COMMON, **overrides, "vocab_size": vocab_size or len(BYTE_TOKENS)}
    if layers is not None:
        fields["num_hidden_layers"] = layers
    torch.manual_seed(sum(map(ord, architecture)))
    model = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, config_class)(**fields)
    ).eval()
    if architecture == "gemma3":
        randomize_norms(model)
    return model


def gguf_tensor_name(hf_name: str, architecture: str = "llama") -> str:
    return gguf_name(hf_name, {**HF_TO_GGUF, **_EXTRA_NAMES, **_FAMILY_NAMES.get(architecture, {})})


def head_dim(config: Any) -> int:
    explicit = config.to_dict().get("head_dim")  # SmolLM3's config has none
    return int(explicit or config.hidden_size // config.num_attention_heads)


def llama3_rope_factors(config: Any) -> np.ndarray:
    """``LlamaModel.generate_extra_tensors``: the divisor of each pair's frequency."""
    params = config.rope_parameters
    dim = head_dim(config)
    freqs = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def _add_hyperparameters(writer: gguf.GGUFWriter, config: Any) -> None:
    """``TextModel.set_gguf_parameters`` and ``LlamaModel.set_gguf_parameters`` for these configs."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    params = config.rope_parameters
    if "full_attention" in params:  # Gemma 3 (``Gemma3Model.set_gguf_parameters``)
        writer.add_rope_freq_base_swa(params["sliding_attention"]["rope_theta"])
        writer.add_sliding_window(config.sliding_window)
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        params = params["full_attention"]
    rope_dims = head_dim(config)
    if params.get("rope_type") == "longrope":  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
        rope_dims = (
            int(params.get("partial_rotary_factor", 1.0) * config.hidden_size) // config.num_attention_heads
        )
        original = params["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(config.sliding_window or 0)
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
    if params.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(params["factor"])
        writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        if params.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(params["beta_fast"])
        if params.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(params["beta_slow"])
    writer.add_rope_freq_base(params["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if config.to_dict().get("head_dim") is not None:  # the converter writes them only from config.json
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(rope_dims)


def write_family_gguf(
    model: Any,
    architecture: str,
    path: Path,
    linear_type: Q = Q.F32,
    vocabulary: Callable[[gguf.GGUFWriter], None] = add_byte_tokenizer,
) -> Path:
    """``model`` converted as llama.cpp's converter does; its 2-D weights in ``linear_type``; its
    tokenizer keys written by ``vocabulary`` (the byte-level one unless told)."""
    config = model.config
    permuted = FAMILY_VARIANTS[architecture][1]
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name(f"tiny {architecture}")
    _add_hyperparameters(writer, config)
    vocabulary(writer)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # not in the checkpoint: tied
        weights = tensor.numpy()
        if architecture == "gemma3" and name.endswith("norm.weight"):
            weights = weights + 1.0  # Gemma3Model.norm_shift: the GGUF holds 1 + w
        if permuted and name.endswith("q_proj.weight"):
            weights = llama_cpp_permute(weights, config.num_attention_heads)
        elif permuted and name.endswith("k_proj.weight"):
            weights = llama_cpp_permute(weights, config.num_key_value_heads)
        qtype = linear_type if weights.ndim == 2 else Q.F32
        data = gguf.quants.quantize(np.ascontiguousarray(weights), qtype)
        writer.add_tensor(
            gguf_tensor_name(name, architecture), data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype
        )
    if config.rope_parameters.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            factors = np.array(config.rope_parameters[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    if config.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- random blocks of the engine's GGML types, at one size for every family ----------------------------

RANDOM_HIDDEN, RANDOM_FFN, RANDOM_HEADS, RANDOM_KV_HEADS, RANDOM_LAYERS, RANDOM_CONTEXT = (
    256,
    512,
    4,
    2,
    4,
    1024,
)
# The variants of the fast-path comparison: GGUF architecture, head_dim, rope_freqs, YaRN.
RANDOM_VARIANTS: dict[str, tuple[str, int, bool, bool]] = {
    "llama": ("llama", 64, False, False),  # the baseline: plain Llama
    "llama_hd128": ("llama", 128, False, False),  # plain Llama of Qwen3's head shapes: Qwen3's baseline
    "llama3": ("llama", 64, True, False),
    "qwen3": ("qwen3", 128, False, False),  # head_dim 128 at hidden 256 / 4 heads
    "smollm3": ("smollm3", 64, False, True),  # layer 3 of 4 NoPE
    "gemma3": ("gemma3", 64, False, False),  # layers 0 and 2 local (window 64), four norms a layer
    "phi3": ("phi3", 64, False, False),  # Phi-4-mini's rotary over 48 of 64 dims, LongRoPE past 256
}
RANDOM_WINDOW = 64
RANDOM_ROTARY = {"phi3": 48}
"""Rotary dims where they are fewer than head_dim (Phi-4-mini's partial_rotary_factor 0.75)."""
RANDOM_GLOBAL_THETA = {"gemma3": 1_000_000.0}
"""Rope bases other than 10,000: Gemma 3's global layers', its local layers keeping 10,000 (as Google's
configs have them), so that a layer on the other's rotary tables shows."""


def _add_random_family_keys(writer: gguf.GGUFWriter, architecture: str) -> None:
    if architecture == "gemma3":  # layers 0 and 2 local: a pattern key, as llama.cpp reads one
        writer.add_sliding_window(RANDOM_WINDOW)
        writer.add_uint32("gemma3.attention.sliding_window_pattern", 2)
        writer.add_rope_freq_base_swa(10000.0)
        writer.add_final_logit_softcapping(30.0)
    if architecture == "phi3":  # LongRoPE's long factors for sequences past 256 positions
        writer.add_rope_scaling_orig_ctx_len(RANDOM_CONTEXT // 4)


def _random_blocks(ggml_type: Q, rows: int, width: int, seed: int, scale: float) -> np.ndarray:
    """``random_blocks``, with each Q4_1 block's min (``m`` in ``d * code + m``) set to ``-8 d``: random
    positive mins give every row the same mean, and a model of such rows answers one token everywhere."""
    from engine.cpu.ggml_kernels import random_blocks

    blocks = random_blocks(ggml_type, rows, width, seed, scale)
    if ggml_type == Q.Q4_1:  # codes 0..15 above a min: a min of -8 d centres them (as Q4_0's)
        halves = blocks.reshape(-1, 20)[:, :4].copy().view(np.float16)
        halves[:, 1] = -8 * halves[:, 0]
        blocks.reshape(-1, 20)[:, :4] = halves.view(np.uint8)
    return blocks


def write_random_family_gguf(path: Path, variant: str, types: dict[str, Q], seed: int = 0) -> Path:
    """A random-weight GGUF of ``variant`` (RANDOM_VARIANTS) whose linears have ``types`` per role
    (``tests/engine/ggml_files.py``'s roles), Q8_0 embedding and Q6_K head, as the converter names them."""
    architecture, dim, rope_freqs, yarn = RANDOM_VARIANTS[variant]
    generator = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name(f"random {variant}")
    writer.add_block_count(RANDOM_LAYERS)
    writer.add_context_length(RANDOM_CONTEXT)
    writer.add_embedding_length(RANDOM_HIDDEN)
    writer.add_feed_forward_length(RANDOM_FFN)
    writer.add_head_count(RANDOM_HEADS)
    writer.add_head_count_kv(RANDOM_KV_HEADS)
    writer.add_rope_freq_base(RANDOM_GLOBAL_THETA.get(variant, 10000.0))
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_key_length(dim)
    writer.add_value_length(dim)
    writer.add_rope_dimension_count(RANDOM_ROTARY.get(variant, dim))
    writer.add_vocab_size(len(BYTE_TOKENS))
    _add_random_family_keys(writer, architecture)
    if yarn:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(RANDOM_CONTEXT // 4)
    add_byte_tokenizer(writer)
    q_rows, kv_rows = RANDOM_HEADS * dim, RANDOM_KV_HEADS * dim
    shapes = {
        "attn_q": (q_rows, RANDOM_HIDDEN),
        "attn_k": (kv_rows, RANDOM_HIDDEN),
        "attn_v": (kv_rows, RANDOM_HIDDEN),
        "attn_output": (RANDOM_HIDDEN, q_rows),
        "ffn_gate": (RANDOM_FFN, RANDOM_HIDDEN),
        "ffn_up": (RANDOM_FFN, RANDOM_HIDDEN),
        "ffn_down": (RANDOM_HIDDEN, RANDOM_FFN),
    }
    if architecture == "phi3":  # stored fused, typed as their v and up parts
        fused = {
            "attn_qkv": ((q_rows + 2 * kv_rows, RANDOM_HIDDEN), "attn_v"),
            "ffn_up": ((2 * RANDOM_FFN, RANDOM_HIDDEN), "ffn_up"),
        }
        for role in ("attn_q", "attn_k", "attn_v", "ffn_gate"):
            del shapes[role]
        shapes.update({role: shape for role, (shape, _) in fused.items()})
        types = {**types, **{role: types[part] for role, (_, part) in fused.items()}}

    def add(name: str, ggml_type: Q, rows: int, width: int, scale: float = 1.0) -> None:
        blocks = _random_blocks(ggml_type, rows, width, int(generator.integers(1 << 30)), scale)
        writer.add_tensor(name, blocks, raw_dtype=ggml_type)

    add("token_embd.weight", Q.Q8_0, len(BYTE_TOKENS), RANDOM_HIDDEN, scale=16.0)
    for layer in range(RANDOM_LAYERS):
        if architecture == "gemma3":  # four norms a layer, as 1 + w
            for norm in ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm"):
                weights = generator.uniform(0.5, 1.5, RANDOM_HIDDEN).astype(np.float32)
                writer.add_tensor(f"blk.{layer}.{norm}.weight", weights)
        else:
            for norm in ("attn_norm", "ffn_norm"):
                writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(RANDOM_HIDDEN, dtype=np.float32))
        if architecture in ("qwen3", "gemma3"):
            for norm in ("attn_q_norm", "attn_k_norm"):
                weights = generator.uniform(0.5, 1.5, dim).astype(np.float32)
                writer.add_tensor(f"blk.{layer}.{norm}.weight", weights)
        for role, (rows, width) in shapes.items():
            add(f"blk.{layer}.{role}.weight", types[role], rows, width)
    writer.add_tensor("output_norm.weight", np.ones(RANDOM_HIDDEN, dtype=np.float32))
    add("output.weight", Q.Q6_K, len(BYTE_TOKENS), RANDOM_HIDDEN, scale=16.0)
    if rope_freqs:
        writer.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, dim // 2, dtype=np.float32))
    if variant == "phi3":
        pairs = RANDOM_ROTARY[variant] // 2
        writer.add_tensor("rope_factors_long.weight", np.linspace(1.0, 16.0, pairs, dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.linspace(1.0, 1.5, pairs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
