"""Model classes by Hugging Face architecture name."""

from __future__ import annotations

from torch import nn

from engine.model_config import ModelConfig
from engine.models.bitnet import BitNetForCausalLM
from engine.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
    "BitNetForCausalLM": BitNetForCausalLM,
}


def model_class_for(config: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_CLASSES[config.architecture]
    except KeyError:
        raise ValueError(f"no model class for architecture {config.architecture!r}") from None
