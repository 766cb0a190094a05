"""Random-weight Hugging Face checkpoints of real model shapes, for side-by-sides with llama-server.

    python -m bench.engine.random_hf --shape qwen3-0.6b --out /tmp/bench/qwen3-0.6b-hf
    python convert_hf_to_gguf.py /tmp/bench/qwen3-0.6b-hf --outtype f16 --outfile q.f16.gguf
    llama-quantize q.f16.gguf q.Q4_K_M.gguf Q4_K_M

``transformers`` writes the checkpoint from each model's published config (the fields that shape
compute: sizes, vocabulary, rope, windows); llama.cpp's own converter then writes the GGUF, so the
file is what a user downloads in all but the weights' values (Gaussians, std 0.02, which speed does
not see). The tokenizer is the default model's (SmolLM2's BPE, 49,152 tokens): the converter pads
the vocabulary to the config's size with ``[PAD<i>]`` tokens, so the embedding and output head keep
their real size. Unlike ``bench.engine.random_gguf`` (plain Llama tensors only), this covers every
family the engine loads.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

_LONGROPE = [1.0 + 0.8 * i for i in range(48)]
"""Phi-4-mini's long factors grow across the 48 rotary pairs; their values do not change speed."""

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-0.6b": (
        "Qwen3Config",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
        ),
    ),
    "llama-3.2-1b": (
        "LlamaConfig",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_scaling=dict(
                rope_type="llama3",
                factor=32.0,
                high_freq_factor=4.0,
                low_freq_factor=1.0,
                original_max_position_embeddings=8192,
            ),
        ),
    ),
    "smollm3-3b": (
        "SmolLM3Config",
        dict(
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=4,
            vocab_size=128256,
            tie_word_embeddings=True,
            rope_theta=5000000.0,
            max_position_embeddings=65536,
            rms_norm_eps=1e-6,
            no_rope_layer_interval=4,
        ),
    ),
    "gemma-3-1b": (
        "Gemma3TextConfig",
        dict(
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            vocab_size=262144,
            query_pre_attn_scalar=256,
            sliding_window=512,
            sliding_window_pattern=6,
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
        ),
    ),
    "phi-4-mini": (
        "Phi3Config",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=24,
            num_key_value_heads=8,
            vocab_size=200064,
            tie_word_embeddings=True,
            partial_rotary_factor=0.75,
            rope_theta=10000.0,
            max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            pad_token_id=0,
            rope_scaling=dict(type="longrope", short_factor=[1.0] * 48, long_factor=_LONGROPE),
        ),
    ),
}
"""The published configs' compute-shaping fields (Hugging Face ``config.json`` of each model)."""


def _tokenizer_dir(into: Path, vocab_size: int) -> None:
    """The default model's tokenizer as a Hugging Face directory (transformers reads the GGUF), its
    vocabulary padded to ``vocab_size`` with ``<unused{i}>`` entries no merge makes (as Gemma's own
    are): the converter trims Gemma 3's embedding rows to the tokenizer's size, and llama-server then
    refuses a file whose embedding is shorter than its vocabulary."""
    from transformers import AutoTokenizer

    from engine.loader import default_model_path

    gguf = default_model_path()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(into)
    # SmolLM2's vocabulary is GPT-2 byte-level BPE, and saying so is what sends the converter's Phi-3
    # class to the tokenizer.json path (Phi-4-mini's own tokenizer_config.json says the same)
    config_file = into / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}, indent=2))
    tokenizer_file = into / "tokenizer.json"
    tokenizer = json.loads(tokenizer_file.read_text())
    vocab = tokenizer["model"]["vocab"]
    taken = len(vocab) + sum(1 for t in tokenizer["added_tokens"] if t["content"] not in vocab)
    for i in range(vocab_size - taken):
        vocab[f"<unused{i}>"] = taken + i
    tokenizer_file.write_text(json.dumps(tokenizer, ensure_ascii=False))


def write(shape: str, out: Path, seed: int = 0) -> None:
    import transformers

    config_class, fields = SHAPES[shape]
    config = getattr(transformers, config_class)(**fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="2GB")
    del model
    with tempfile.TemporaryDirectory() as tokenizer:
        _tokenizer_dir(Path(tokenizer), config.vocab_size)
        for item in Path(tokenizer).iterdir():
            shutil.copy(item, out / item.name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=SHAPES, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    write(args.shape, args.out, args.seed)


if __name__ == "__main__":
    main()
