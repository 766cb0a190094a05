"""Model classes by the model code a family names (``engine/families``, ``Family.model``)."""

from __future__ import annotations

from engine.families import family_for_hf
from engine.model_config import ModelConfig
from engine.models.bitnet import BitNetForCausalLM
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.phi3 import Phi3ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "bitnet": BitNetForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "phi3": Phi3ForCausalLM,
}


def model_class_for(config: ModelConfig) -> type[LlamaForCausalLM]:
    return MODEL_CLASSES[family_for_hf(config.architecture).model]
