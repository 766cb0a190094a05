"""One description of a model's shape, whether it came from a Hugging Face directory or a GGUF file.

Everything downstream (the model, the KV-cache sizing, the tokenizer's stop ids) reads this
dataclass, so the two on-disk formats only differ here and in the weight loaders.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.families import family_for_gguf, family_for_hf

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LONGROPE_FIELDS = ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor")
"""LongRoPE as Phi-3's family fills it in (``engine/families/phi3.py``); no other family reads it."""
ROPE_FREQS_TENSOR = "rope_freqs.weight"
"""llama.cpp's per-pair rope divisors (Llama 3.1's scaling as its converter writes it)."""
CONFIG_TENSORS = (ROPE_FREQS_TENSOR, "rope_factors_long.weight", "rope_factors_short.weight")
"""GGUF tensors that are configuration, not weights: read into the config (Phi-3's LongRoPE factors
go to its family's ``gguf_extras``), skipped by the weight reader."""


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
    """None for plain RoPE, else the HF dict with a `rope_type` of "linear", "llama3" or "yarn"."""
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
    qk_norm: bool = False
    """A per-head RMSNorm over head_dim on q and k before rotary (Qwen3)."""
    nope_layers: tuple[int, ...] = ()
    """Layers that apply no rotary (SmolLM3's NoPE layers)."""
    rope_freq_factors: tuple[float, ...] | None = None
    """A GGUF's ``rope_freqs`` tensor: each pair's inverse frequency is divided by its factor, as
    llama.cpp does (how its converter stores Llama 3.1's rope scaling). None: none."""
    rotary_dim: int | None = None
    """How many of each head's leading dims rotary turns (Phi-3's ``partial_rotary_factor``); None:
    all of them."""
    sliding_window: int | None = None
    """The window of the ``sliding_layers``: each of their tokens attends to the last this many
    positions, itself included (transformers' and llama.cpp's masks). None: no local layers."""
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None
    """The rope base of the sliding layers, which apply no rope scaling (Gemma 3). None: the
    global rope serves every layer."""
    attention_scale: float | None = None
    """What q.k is multiplied by (Gemma 3's ``query_pre_attn_scalar ** -0.5``); None: head_dim ** -0.5."""
    embedding_scale: float = 1.0
    """What the token embeddings are multiplied by (Gemma: sqrt(hidden))."""
    final_logit_softcap: float | None = None
    """Logits become ``tanh(logits / c) * c`` (Gemma 3 where its config has one)."""

    def __post_init__(self) -> None:
        family = family_for_hf(self.architecture)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        expected_act = family.hidden_acts
        if self.hidden_act not in expected_act:
            implemented = " or ".join(expected_act)
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; {self.architecture} implements {implemented}"
            )
        scaling = self.rope_scaling or {}
        rope_type = scaling.get("rope_type", "default")
        longrope = rope_type == "longrope" and all(name in scaling for name in LONGROPE_FIELDS)
        if rope_type not in SUPPORTED_ROPE_TYPES and not longrope:
            raise ValueError(
                f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                " (longrope: Phi3ForCausalLM)"
            )
        factors = self.rope_freq_factors
        if factors is not None and len(factors) != self.head_dim // 2:
            raise ValueError(
                f"rope_freqs has {len(factors)} factors; head_dim {self.head_dim} needs {self.head_dim // 2}"
            )
        if any(not 0 <= i < self.num_hidden_layers for i in (*self.nope_layers, *self.sliding_layers)):
            raise ValueError(
                f"no-rope layers {self.nope_layers} or sliding layers {self.sliding_layers} outside the "
                f"model's {self.num_hidden_layers}"
            )
        if self.sliding_layers and not (self.sliding_window or 0) > 0:
            raise ValueError(f"sliding layers {self.sliding_layers} without a positive sliding_window")
        if self.rotary_dim is not None and not (
            0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0
        ):
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and within head_dim {self.head_dim}")

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
        family = family_for_hf(architecture)
        hidden_size = config["hidden_size"]
        num_heads = config["num_attention_heads"]
        rope_theta, rope_scaling = _hf_rope(config)
        eos = (generation_config or {}).get("eos_token_id", config.get("eos_token_id"))
        fields: dict[str, Any] = dict(
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
            attention_bias=family.qkv_bias(config),
            attention_out_bias=family.o_bias(config),
            mlp_bias=bool(config.get("mlp_bias", False)),
            hidden_act=config.get("hidden_act", "silu"),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_as_ids(eos),
            qk_norm=family.qk_norm,
            nope_layers=family.hf_nope_layers(config),
        )
        return cls(**{**fields, **family.hf_extras(config)})

    # -- GGUF -----------------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(
        cls,
        metadata: Mapping[str, Any],
        tensor_names: set[str],
        rope_freq_factors: Sequence[float] | None = None,
        config_tensors: Mapping[str, Sequence[float]] | None = None,
    ) -> ModelConfig:
        """Build from GGUF key/values (see `engine.loader.gguf_file.read_metadata`) and tensor names;
        ``rope_freq_factors``: the file's ``rope_freqs`` tensor where it has one; ``config_tensors``:
        its ``CONFIG_TENSORS`` by name (the family's ``gguf_extras`` reads them)."""
        arch = metadata["general.architecture"]
        family = family_for_gguf(arch)
        if ROPE_FREQS_TENSOR in tensor_names and rope_freq_factors is None:
            raise ValueError("this GGUF has a rope_freqs tensor: pass its values as rope_freq_factors")

        def key(name: str, default: Any = None) -> Any:
            return metadata.get(f"{arch}.{name}", default)

        hidden_size = key("embedding_length")
        num_heads = key("attention.head_count")
        head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden_size // num_heads
        tokens = metadata.get("tokenizer.ggml.tokens")
        num_layers = key("block_count")
        fields: dict[str, Any] = dict(
            architecture=family.hf_architectures[0],
            vocab_size=key("vocab_size") or len(tokens or ()),
            hidden_size=hidden_size,
            intermediate_size=key("feed_forward_length"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=key("attention.head_count_kv") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(key),
            max_position_embeddings=key("context_length", 2048),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            attention_out_bias="blk.0.attn_output.bias" in tensor_names,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_gguf_eos_ids(metadata),
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            nope_layers=family.gguf_nope_layers(num_layers),
            rope_freq_factors=None if rope_freq_factors is None else tuple(map(float, rope_freq_factors)),
        )
        return cls(**{**fields, **family.gguf_extras(key, num_layers, config_tensors or {})})


def _gguf_rope_scaling(key: Callable[[str, Any], Any]) -> dict[str, Any] | None:
    """The HF rope_scaling dict of a GGUF's ``<arch>.rope.scaling.*`` keys (llama.cpp's converter's)."""
    scaling_type = key("rope.scaling.type", "none")
    if scaling_type == "none":
        return None

    def required(name: str) -> Any:
        value = key(f"rope.scaling.{name}", None)
        if value is None:
            raise ValueError(f"GGUF rope scaling {scaling_type!r} without rope.scaling.{name}")
        return value

    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(required("factor"))}
    if scaling_type == "yarn":
        yarn: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": float(required("factor")),
            "original_max_position_embeddings": int(required("original_context_length")),
        }
        for gguf_key, hf_key in _YARN_KEYS.items():
            if (value := key(f"rope.scaling.{gguf_key}", None)) is not None:
                yarn[hf_key] = float(value)
        return yarn
    raise ValueError(
        f"unsupported GGUF rope scaling {scaling_type!r}; supported: none, linear, yarn, a rope_freqs tensor"
    )


# GGUF rope.scaling.<key> -> the HF yarn parameter it was written from (convert_hf_to_gguf.py).
_YARN_KEYS = {
    "yarn_attn_factor": "attention_factor",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}


def _gguf_eos_ids(metadata: Mapping[str, Any]) -> tuple[int, ...]:
    """The file's eos, end-of-turn and end-of-message ids, and Llama 3's end tokens by their text (its
    GGUFs name only one, as llama.cpp finds the others: ``generation_config.json`` lists all three)."""
    ids = [metadata.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    tokens = metadata.get("tokenizer.ggml.tokens") or ()
    if _LLAMA3_END_TOKENS[0] in tokens:
        index = {token: i for i, token in enumerate(tokens) if token.startswith("<|")}
        ids.extend(index.get(token) for token in _LLAMA3_END_TOKENS)
    return tuple(dict.fromkeys(i for i in ids if i is not None))


_LLAMA3_END_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")


def _context_length(config: Mapping[str, Any]) -> int:
    """max_position_embeddings, capped at a sliding attention window when the model uses one.

    Full attention equals sliding-window attention while a sequence fits in the window, so
    capping the context keeps outputs exact for the families (Mistral, Qwen2) whose windows the
    engine does not run; a family that runs its window (Gemma 3: ``ModelConfig.sliding_layers``)
    sets the full context in its ``hf_extras``.
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
