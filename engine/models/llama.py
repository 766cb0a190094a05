"""Llama-family decoder (Llama, Mistral, Qwen2) over one flat batch of tokens.

Parameter names follow Hugging Face (`model.layers.N.self_attn.q_proj.weight`), so a HF state
dict loads as is. Projections are plain `nn.Linear` so quantized linears can be swapped in after
loading. Everything about sequences (which tokens belong together, where K/V go) lives in the
context object that `Attention` reads; this file only does the per-token math.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.model_config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, q_size, kv_size = (
            config.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        self.q_proj = nn.Linear(hidden, q_size, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=config.attention_out_bias)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, scale=self.head_dim**-0.5)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    # Variants (BitNet) swap the blocks through these attributes; the layer's wiring stays one piece of code.
    attention_cls: type[nn.Module] = LlamaAttention
    mlp_cls: type[nn.Module] = LlamaMLP

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config)
        self.mlp = self.mlp_cls(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    model_cls: type[nn.Module] = LlamaModel

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head with the embedding when the config says so (again after `to_empty`, which unties)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden_size]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size]."""
        return self.lm_head(hidden).float()
