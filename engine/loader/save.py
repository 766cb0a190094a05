"""Write a Hugging Face model directory that `load_model` (and transformers) can read back.

`config.json`, `generation_config.json`, the tokenizer files and one `model.safetensors`. A source
directory's tokenizer and generation files are copied as they are; for a GGUF source they are
written from what the loader built out of its metadata (the `tokenizers` object saves itself as
`tokenizer.json`; the chat template and special tokens go in `tokenizer_config.json`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.model_config import ModelConfig
from engine.tokenizer import Tokenizer

WEIGHTS_FILE = "model.safetensors"
_HF_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "SmolLM3ForCausalLM": "smollm3",
}
# Files of a source directory that describe its weights: written anew, never copied.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_WEIGHT_FILES = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """`config.json` contents for a model we only know as a `ModelConfig` (a GGUF file);
    `ModelConfig.from_hf_dict` reads it back to an equal config."""
    model_type = _HF_MODEL_TYPES.get(config.architecture)
    if model_type is None:
        raise ValueError(f"cannot write a Hugging Face config for {config.architecture}")
    if config.rope_freq_factors is not None:
        # transformers' llama3 parameters cannot be recovered from the divisors alone
        raise ValueError("cannot write a Hugging Face config for a GGUF's rope_freqs (llama3 rope) tensor")
    out: dict[str, Any] = {
        "architectures": [config.architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": _ids_value(config.eos_token_ids),
    }
    if model_type == "qwen2":
        out["use_sliding_window"] = False
    elif model_type == "qwen3":
        out["use_sliding_window"] = False
        out["attention_bias"] = config.attention_bias
    else:
        if config.attention_bias != config.attention_out_bias:
            raise ValueError(f"{config.architecture} configs cannot say q/k/v bias without o_proj bias")
        out["attention_bias"] = config.attention_bias
        out["mlp_bias"] = config.mlp_bias
    if model_type == "smollm3":
        out["no_rope_layers"] = [int(i not in config.nope_layers) for i in range(config.num_hidden_layers)]
    return out


def save_hf_dir(
    out: Path,
    *,
    source: Path,
    config: ModelConfig,
    tokenizer: Tokenizer,
    tensors: Mapping[str, torch.Tensor],
    config_updates: Mapping[str, Any],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write the directory `out` (created; it must not hold files yet).

    `source` is the checkpoint the model was loaded from; `config_updates` are merged into its
    `config.json` (e.g. a `quantization_config`); `metadata` goes in the safetensors header.
    """
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    if source.is_dir():
        hf_config = json.loads((source / "config.json").read_text())
        _copy_non_weight_files(source, out)
    else:
        hf_config = hf_config_dict(config)
        write_tokenizer(out, config, tokenizer)
    _write_json(out / "config.json", {**hf_config, **config_updates})
    save_file(
        {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()},
        out / WEIGHTS_FILE,
        metadata={"format": "pt", **(metadata or {})},
    )


def _copy_non_weight_files(source: Path, out: Path) -> None:
    """Tokenizer, chat template, generation config, license, README: everything but the weights."""
    for item in source.iterdir():
        if item.is_file() and item.name not in _WEIGHT_FILES and not item.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy(item, out / item.name)


def write_tokenizer(out: Path, config: ModelConfig, tokenizer: Tokenizer) -> None:
    """`tokenizer.json`, `tokenizer_config.json` and `generation_config.json` of a loaded model."""
    tokenizer.backend.save(str(out / "tokenizer.json"))
    special = {name: token for name, token in tokenizer.special_tokens.items() if token is not None}
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "chat_template": tokenizer.chat_template,
            "model_max_length": config.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
        },
    )
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": config.bos_token_id, "eos_token_id": _ids_value(config.eos_token_ids)},
    )


def _ids_value(ids: tuple[int, ...]) -> int | list[int] | None:
    """One id as an int (the usual spelling), several as a list, none as null."""
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
