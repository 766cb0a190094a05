"""One description of a model's shape, whether it came from a Hugging Face directory or a GGUF file.

Everything downstream (the model, the KV-cache sizing, the tokenizer's stop ids) reads this
dataclass, so the two on-disk formats only differ here and in the weight loaders.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "BitNetForCausalLM")
# The MLP activations each architecture implements (BitNet b1.58: squared ReLU, as transformers' model;
# SiLU as llama.cpp's "bitnet" graph computes a GGUF of it, whose metadata names no activation).
_HIDDEN_ACTS = {"BitNetForCausalLM": ("relu2", "silu")}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# GGUF `general.architecture` -> Hugging Face architecture.
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "bitnet": "BitNetForCausalLM",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    """None for plain RoPE, else the HF dict with a `rope_type` of "linear" or "llama3"."""
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    """Bias on q/k/v projections (Qwen2 always, Llama when `attention_bias` is set)."""
    attention_out_bias: bool = False
    """Bias on o_proj: Llama's `attention_bias` covers it, Qwen2's qkv bias does not."""
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        expected_act = _HIDDEN_ACTS.get(self.architecture, ("silu",))
        if self.hidden_act not in expected_act:
            implemented = " or ".join(expected_act)
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; {self.architecture} implements {implemented}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    # -- Hugging Face -------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json`, with eos ids from `generation_config.json` when it has them."""
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        generation_file = path / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.exists() else {}
        return cls.from_hf_dict(config, generation)

    @classmethod
    def from_hf_dict(
        cls, config: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None
    ) -> ModelConfig:
        architectures = config.get("architectures") or []
        if not architectures:
            raise ValueError("config.json names no architecture")
        architecture = architectures[0]
        hidden_size = config["hidden_size"]
        num_heads = config["num_attention_heads"]
        rope_theta, rope_scaling = _hf_rope(config)
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        llama_bias = bool(config.get("attention_bias", False))
        eos = (generation_config or {}).get("eos_token_id", config.get("eos_token_id"))
        return cls(
            architecture=architecture,
            vocab_size=config["vocab_size"],
            hidden_size=hidden_size,
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden_size // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_context_length(config),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=True if is_qwen2 else llama_bias,
            attention_out_bias=False if is_qwen2 else llama_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            hidden_act=config.get("hidden_act", "silu"),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_as_ids(eos),
        )

    # -- GGUF -----------------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
        """Build from GGUF key/values (see `engine.loader.gguf_file.read_metadata`) and tensor names."""
        arch = metadata["general.architecture"]
        if arch not in _GGUF_ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_GGUF_ARCHITECTURES)}"
            )
        if "rope_freqs.weight" in tensor_names:
            raise ValueError("GGUF files with a rope_freqs tensor (llama3 rope scaling) are not supported")

        def key(name: str, default: Any = None) -> Any:
            return metadata.get(f"{arch}.{name}", default)

        hidden_size = key("embedding_length")
        num_heads = key("attention.head_count")
        head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden_size // num_heads
        scaling_type = key("rope.scaling.type", "none")
        rope_scaling = None
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        elif scaling_type != "none":
            raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}")
        has_qkv_bias = "blk.0.attn_q.bias" in tensor_names
        tokens = metadata.get("tokenizer.ggml.tokens")
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=_GGUF_ARCHITECTURES[arch],
            vocab_size=key("vocab_size") or len(tokens or ()),
            hidden_size=hidden_size,
            intermediate_size=key("feed_forward_length"),
            num_hidden_layers=key("block_count"),
            num_attention_heads=num_heads,
            num_key_value_heads=key("attention.head_count_kv") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=key("context_length", 2048),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias=has_qkv_bias,
            attention_out_bias="blk.0.attn_output.bias" in tensor_names,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_as_ids(eos),
        )


def _context_length(config: Mapping[str, Any]) -> int:
    """max_position_embeddings, capped at a sliding attention window when the model uses one.

    Full attention equals sliding-window attention while a sequence fits in the window, so
    capping the context keeps outputs exact without implementing the window.
    """
    length = config.get("max_position_embeddings", 2048)
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    return min(length, window) if window else length


def _hf_rope(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the classic keys or transformers 5's `rope_parameters`."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    merged = {**params, **scaling}
    rope_type = merged.pop("rope_type", merged.pop("type", "default"))
    merged.pop("type", None)
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **merged}


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)
