"""Shared engine fixtures: the default GGUF, its tokenizer, and tiny random-weight HF models.

Everything expensive is session-scoped: the real default model is loaded once, and the tiny
models are written to a temp dir once. transformers is imported lazily (only tests that compare
against it pay for the import).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import engine.kernels  # noqa: F401  (turns Triton's CPU interpreter on before anything imports triton)
from engine.loader import LoadedModel, default_model_path, load_model, load_tokenizer
from engine.tokenizer import Tokenizer
from tests.engine.tiny_engine import byte_tokenizer, make_engine  # noqa: F401  (fixtures)

# Tiny architectures checked against transformers. Shapes stay small so CPU tests are quick;
# the vocabulary is the real SmolLM2 one so prompts are real text.
TINY_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,  # wide logits: greedy picks are far from ties
    "bos_token_id": 1,
    "eos_token_id": 2,
}
GEMMA3_FIELDS: dict[str, Any] = {
    "num_hidden_layers": 6,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "sliding_window": 6,
    "final_logit_softcapping": 30.0,
    "pad_token_id": None,
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
}
TINY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama 3.1-style rope scaling; wavelengths fall in all three of its bands at head_dim 16.
    "llama3": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    "qwen2": ("Qwen2Config", {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    # Tied embeddings, 4 query heads sharing one KV head, and Llama's attention/MLP biases.
    "llama_tied_gqa": (
        "LlamaConfig",
        {"tie_word_embeddings": True, "num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True},
    ),
    # Per-head q/k RMSNorm; head_dim 32 where hidden / heads is 16.
    "qwen3": (
        "Qwen3Config",
        {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    ),
    # Layer 3 of 4 without rotary (NoPE), YaRN: at head_dim 16 its ramp spans pairs 0-3 of 8.
    "smollm3": (
        "SmolLM3Config",
        {
            "num_hidden_layers": 4,
            "pad_token_id": None,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        },
    ),
    # Gemma 3: six layers, 0-4 local (window 6, rope base 1e4), layer 5 global
    # (1e6), as the default pattern and llama.cpp's have it; logits soft-capped; norms (1 + w).
    "gemma3": ("Gemma3TextConfig", GEMMA3_FIELDS),
    # Three layers with their own layer_types, and a query scale that is not head_dim's.
    "gemma3_layer_types": (
        "Gemma3TextConfig",
        {
            **GEMMA3_FIELDS,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 24,
        },
    ),
    # Phi-4-mini's shape: fused qkv / gate_up, rotary over 12 of 16 dims, LongRoPE whose long factors
    # start at position 64 (prompts stay under it, greedy tokens run past it), cos/sin scaled.
    "phi3": (
        "Phi3Config",
        {
            "max_position_embeddings": 256,
            "original_max_position_embeddings": 64,
            "pad_token_id": None,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(6)],
                "long_factor": [2.0 + 0.5 * i for i in range(6)],
            },
        },
    ),
}
# Variants saved as several safetensors shards with an index json.
SHARDED_VARIANTS = {"qwen2"}
EVALUATION_TEXT = Path(__file__).parent.parent / "data" / "pride_and_prejudice_ch1.txt"


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for tiny models: on a shared 2-core machine, two threads spin-wait each
    other many times slower. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    path = default_model_path()
    assert path.exists(), f"default model file missing: {path}"
    return path


@pytest.fixture(scope="session")
def default_model(default_gguf_path: Path) -> LoadedModel:
    """The real SmolLM2-135M-Instruct GGUF, float32 on CPU, loaded once per session."""
    return load_model(default_gguf_path, device="cpu", dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def float32_perplexity(default_model: LoadedModel) -> float:
    """The exact float32 path's perplexity on the evaluation text: the baseline that the fast path's
    and the INT4 quality tests compare with, computed once (about 8 s)."""
    from bench.engine.int4_quality import perplexity

    return perplexity(
        default_model.model, evaluation_ids(default_model), default_model.config.max_position_embeddings
    )


def evaluation_ids(model: LoadedModel) -> torch.Tensor:
    """The evaluation text (Pride and Prejudice, ch. 1: not the calibration text) as token ids."""
    return torch.tensor(model.tokenizer.encode(EVALUATION_TEXT.read_text()))


@pytest.fixture(scope="session")
def hf_gguf_config(default_gguf_path: Path) -> Any:
    """transformers' config from the default GGUF (it parses all the file's metadata: about 7 s)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(default_gguf_path.parent, gguf_file=default_gguf_path.name)


@pytest.fixture(scope="session")
def default_tokenizer(default_gguf_path: Path) -> Tokenizer:
    """Our tokenizer from the default GGUF's metadata (without loading its weights)."""
    return load_tokenizer(default_gguf_path)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(default_gguf_path: Path) -> Any:
    """transformers' own tokenizer built from the default GGUF (the reference for ours)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf_path.parent, gguf_file=default_gguf_path.name)


@pytest.fixture(scope="session")
def hf_tokenizer_dir(hf_gguf_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json, chat template)."""
    path = tmp_path_factory.mktemp("hf_tokenizer")
    hf_gguf_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(hf_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory: variant name (see TINY_VARIANTS) -> a saved random-weight HF model directory."""
    made: dict[str, Path] = {}

    def make(variant: str) -> Path:
        if variant not in made:
            made[variant] = _save_tiny_model(variant, hf_tokenizer_dir, tmp_path_factory.mktemp(variant))
        return made[variant]

    return make


def randomize_norms(model: Any) -> None:
    """Gemma initialises its norms' ``w`` of ``1 + w`` to zero: random ones, so that a norm read
    without its offset (or with it twice) shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)


def _save_tiny_model(variant: str, tokenizer_dir: Path, path: Path) -> Path:
    import transformers

    config_class, overrides = TINY_VARIANTS[variant]
    vocab_size = len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    config = getattr(transformers, config_class)(vocab_size=vocab_size, **{**TINY_COMMON, **overrides})
    torch.manual_seed(sum(map(ord, variant)))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if config_class.startswith("Gemma"):
        randomize_norms(model)
    shard_size = "200KB" if variant in SHARDED_VARIANTS else "1GB"
    model.save_pretrained(path, max_shard_size=shard_size)
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, path / item.name)
    return path
