"""Phi-3 / Phi-4-mini: the Llama decoder whose q/k/v and gate/up projections are one linear each as
stored (the state dict's ``qkv_proj`` and ``gate_up_proj``: what :meth:`fuse_projections` makes of a
Llama model). Partial rotary and LongRoPE are the config's (``engine/families/phi3.py``)."""

from __future__ import annotations

from torch import nn

from engine.model_config import ModelConfig
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


class Phi3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        for name in ("q_proj", "k_proj", "v_proj"):
            delattr(self, name)
        self.qkv_proj = nn.Linear(config.hidden_size, rows, bias=config.attention_bias)


class Phi3MLP(LlamaMLP):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        for name in ("gate_proj", "up_proj"):
            delattr(self, name)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)


class Phi3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Phi3Attention
    mlp_cls = Phi3MLP


class Phi3Model(LlamaModel):
    layer_cls = Phi3DecoderLayer


class Phi3ForCausalLM(LlamaForCausalLM):
    model_cls = Phi3Model
