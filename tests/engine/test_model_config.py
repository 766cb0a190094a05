"""ModelConfig from HF config.json (classic and transformers-5 rope keys) and from GGUF metadata."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.loader.gguf_file import open_gguf, read_metadata
from engine.model_config import ModelConfig
from tests.engine.conftest import TINY_VARIANTS

# The shape of Llama-3.2-1B-Instruct's config.json (classic keys, rope_scaling dict, eos list).
LLAMA_32_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "vocab_size": 128256,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


def test_classic_hf_config() -> None:
    config = ModelConfig.from_hf_dict(LLAMA_32_CONFIG)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 8, 64)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {
        "rope_type": "llama3",
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
    }
    assert config.tie_word_embeddings and not config.attention_bias
    assert config.eos_token_ids == (128001, 128008, 128009)


def test_generation_config_eos_wins_over_config() -> None:
    config = ModelConfig.from_hf_dict(LLAMA_32_CONFIG, {"eos_token_id": 128009})
    assert config.eos_token_ids == (128009,)


def test_legacy_rope_scaling_type_key() -> None:
    raw = {**LLAMA_32_CONFIG, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert ModelConfig.from_hf_dict(raw).rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_head_dim_defaults_to_hidden_over_heads() -> None:
    raw = {k: v for k, v in LLAMA_32_CONFIG.items() if k != "head_dim"}
    assert ModelConfig.from_hf_dict(raw).head_dim == 2048 // 32


def test_sliding_window_caps_the_context() -> None:
    mistral = {**LLAMA_32_CONFIG, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    assert ModelConfig.from_hf_dict(mistral).max_position_embeddings == 4096
    assert ModelConfig.from_hf_dict({**mistral, "sliding_window": None}).max_position_embeddings == 131072
    qwen2 = {**mistral, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False}
    assert ModelConfig.from_hf_dict(qwen2).max_position_embeddings == 131072


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            r"unsupported architecture 'GPT2LMHeadModel'; supported: .*Qwen3ForCausalLM.*SmolLM3ForCausalLM"
            r".* \(Hugging Face\); llama, qwen2, qwen3, smollm3, gemma3, phi3, bitnet \(GGUF\)$",
        ),
        ({"architectures": []}, "names no architecture"),
        (
            {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
            r"unsupported rope scaling 'longrope'; supported: default, linear, llama3, yarn \(longrope: Phi3"
            r"ForCausalLM\)$",
        ),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 5}, "multiple of num_key_value_heads"),
    ],
)
def test_unsupported_configs_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict({**LLAMA_32_CONFIG, **change})


def test_gemma3_configs_as_google_wrote_them() -> None:
    """Gemma 3 1B's config.json keys (transformers 4.5x: rope_local_base_freq, sliding_window_pattern,
    no layer_types): every 6th layer global, its own rope bases; a Gemma 2 attention soft-cap refused."""
    config = {
        **LLAMA_32_CONFIG,
        "architectures": ["Gemma3ForCausalLM"],
        "num_hidden_layers": 12,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 32768,
    }
    gemma = ModelConfig.from_hf_dict(config)
    assert gemma.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10) and gemma.sliding_window == 512
    assert (gemma.rope_theta, gemma.rope_local_theta, gemma.rope_scaling) == (1000000.0, 10000.0, None)
    assert gemma.max_position_embeddings == 32768 and gemma.attention_scale == 256**-0.5
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelConfig.from_hf_dict({**config, "attn_logit_softcapping": 50.0})


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_saved_transformers_configs(variant: str, tiny_model_dir: Callable[[str], Path]) -> None:
    """Configs as transformers 5 writes them (rope_parameters, generation_config.json)."""
    from transformers import AutoConfig

    path = tiny_model_dir(variant)
    hf = AutoConfig.from_pretrained(path)
    config = ModelConfig.from_hf_dir(path)
    assert config.architecture == hf.architectures[0]
    assert config.vocab_size == hf.vocab_size
    assert config.num_hidden_layers == hf.num_hidden_layers
    assert config.num_key_value_heads == hf.num_key_value_heads
    expected_head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert config.head_dim == expected_head_dim
    rope = hf.rope_parameters.get("full_attention", hf.rope_parameters)  # Gemma 3's global layers'
    assert config.rope_theta == rope["rope_theta"]
    assert (config.rope_scaling or {}).get("rope_type", "default") == rope["rope_type"]
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert config.attention_bias == (variant in ("qwen2", "llama_tied_gqa"))
    assert config.attention_out_bias == config.mlp_bias == (variant == "llama_tied_gqa")
    generation = json.loads((path / "generation_config.json").read_text())
    assert config.eos_token_ids == (generation["eos_token_id"],)


def test_default_gguf_config_matches_transformers(default_gguf_path: Path, hf_gguf_config: Any) -> None:
    reader = open_gguf(default_gguf_path)
    config = ModelConfig.from_gguf_metadata(read_metadata(reader), {t.name for t in reader.tensors})
    hf = hf_gguf_config
    assert (config.architecture, hf.model_type) == ("LlamaForCausalLM", "llama")
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert getattr(config, field) == getattr(hf, field), field
    assert config.head_dim == hf.hidden_size // hf.num_attention_heads
    assert config.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    assert config.rope_scaling is None
    assert (config.bos_token_id, config.eos_token_ids) == (hf.bos_token_id, (hf.eos_token_id,))


def test_gguf_metadata_errors() -> None:
    metadata = {
        "general.architecture": "llama",
        "llama.embedding_length": 64,
        "llama.attention.head_count": 4,
    }
    with pytest.raises(ValueError, match="rope_freqs"):
        ModelConfig.from_gguf_metadata(metadata, {"rope_freqs.weight"})
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'"):
        ModelConfig.from_gguf_metadata({"general.architecture": "gemma"}, set())
    with pytest.raises(
        ValueError, match="unsupported GGUF rope scaling 'longrope'; supported: none, linear, yarn"
    ):
        ModelConfig.from_gguf_metadata({**metadata, "llama.rope.scaling.type": "longrope"}, set())
    with pytest.raises(ValueError, match=r"'yarn' without rope\.scaling\.factor"):
        ModelConfig.from_gguf_metadata({**metadata, "llama.rope.scaling.type": "yarn"}, set())
