"""Write a Hugging Face model directory that `load_model` (and transformers) can read back.

`config.json`, `generation_config.json`, the tokenizer files and one `model.safetensors`. A source
directory's tokenizer and generation files are copied as they are; for a GGUF source they are
written from what the loader built out of its metadata (the `tokenizers` object saves itself as
`tokenizer.json`; the chat template and special tokens go in `tokenizer_config.json`).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.families import family_for_hf
from engine.model_config import ModelConfig
from engine.tokenizer import Tokenizer

WEIGHTS_FILE = "model.safetensors"
_HF_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "SmolLM3ForCausalLM": "smollm3",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
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
        # A GGUF's pad id is the tokenizer's business; the configs' defaults (Phi-3's 32000, SmolLM3's
        # 128004) would fall outside a smaller vocabulary's embedding.
        "pad_token_id": None,
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
    elif model_type == "gemma3_text":
        out |= _gemma3_fields(config)
    elif model_type == "phi3":
        out |= _phi3_fields(config)
    return out


def _gemma3_fields(config: ModelConfig) -> dict[str, Any]:
    """Gemma 3's keys as its config.json spells them (``engine/families/gemma3.py`` reads them back):
    each layer's kind, the local layers' window and rope base, the query scalar, the soft-cap."""
    scale = config.attention_scale if config.attention_scale is not None else config.head_dim**-0.5
    scalar = scale**-2.0
    return {
        "hidden_activation": config.hidden_act,
        "layer_types": [
            "sliding_attention" if i in config.sliding_layers else "full_attention"
            for i in range(config.num_hidden_layers)
        ],
        "sliding_window": config.sliding_window,
        "rope_local_base_freq": config.rope_local_theta or config.rope_theta,
        # an integer in every Gemma config; the round trip through ** -0.5 leaves an ulp or two
        "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
        "final_logit_softcapping": config.final_logit_softcap,
        "attn_logit_softcapping": None,
    }


def _phi3_fields(config: ModelConfig) -> dict[str, Any]:
    """Phi-3's keys: rotary over the leading ``partial_rotary_factor`` of each head, and LongRoPE's
    factors (``engine/families/phi3.py``). No sliding window: the engine runs Phi-3 without one."""
    rotary = config.rotary_dim or config.head_dim
    partial = rotary / config.head_dim
    while int(config.head_dim * partial) < rotary:  # read back as int(head_dim * factor)
        partial = math.nextafter(partial, 1.0)
    fields: dict[str, Any] = {"partial_rotary_factor": partial, "sliding_window": None}
    scaling = config.rope_scaling
    if scaling is not None and scaling.get("rope_type") == "longrope":
        fields["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
        fields["rope_scaling"] = {
            "type": "longrope",
            "short_factor": list(scaling["short_factor"]),
            "long_factor": list(scaling["long_factor"]),
            "attention_factor": scaling["attention_factor"],
        }
    return fields


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
    `tensors` are named and valued as the checkpoint holds them (:func:`as_stored`).
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


def as_stored(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A model's parameter as a Hugging Face checkpoint of its family stores it: norms less the offset
    the loader adds (Gemma's ``1 + w``: ``Family.hf_norm_offset``), in float32 (cast after, not before:
    ``1 + w`` in float16 would round ``w`` to a thousandth)."""
    offset = family_for_hf(config.architecture).hf_norm_offset
    if not offset or not name.endswith("norm.weight"):
        return tensor
    return tensor.float() - offset


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
