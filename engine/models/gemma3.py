"""Gemma 3 (text): the Llama decoder with a norm after attention and after the MLP as well as before
each (``engine/families/gemma3.py`` lists the rest, all config-driven in ``engine/models/llama.py``:
GeGLU, q/k norm, query scale, scaled embeddings, sliding-window layers with their own rope, logit
soft-capping).

The norms' weights are ``1 + w`` as loaded (``Family.hf_norm_offset``), so they are plain RMSNorms.
"""

from __future__ import annotations

import torch

from engine.layers.norm import RMSNorm
from engine.model_config import ModelConfig
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Gemma3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # post_attention_layernorm is Gemma's norm of the attention's output (Llama's pre-MLP norm).
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma3Model(LlamaModel):
    layer_cls = Gemma3DecoderLayer


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_cls = Gemma3Model
