"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM3) over one flat batch of tokens.

The families' differences are per layer and declared in ``engine/families``: Qwen3's per-head
q/k RMSNorm (``q_norm``/``k_norm``) and SmolLM3's NoPE layers (``rotary`` False).

Parameter names follow Hugging Face (`model.layers.N.self_attn.q_proj.weight`), so a HF state
dict loads as is. Projections are plain `nn.Linear` so quantized linears can be swapped in after
loading. Everything about sequences (which tokens belong together, where K/V go) lives in the
context object that `Attention` reads; this file only does the per-token math.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.layers.activation import gated_activation
from engine.layers.attention import Attention
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.layers.stacking import stack_linears
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
        self.qkv_proj: nn.Module | None = None
        """q, k and v stacked into one linear by :meth:`fuse_projections` (then the three are gone)."""
        scale = config.attention_scale or self.head_dim**-0.5
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, scale=scale)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary_dim = config.rotary_dim or self.head_dim
        """The leading dims of each head that rotary turns (fewer than head_dim: partial rotary, Phi-3)."""
        self.rotary = True
        """False on a NoPE layer (set by :class:`LlamaModel` from ``ModelConfig.nope_layers``)."""

    def fuse_projections(self) -> bool:
        if self.qkv_proj is None:
            self.qkv_proj = _stacked_linear(self, ("q_proj", "k_proj", "v_proj"))
        return self.qkv_proj is not None

    def rotated_qkv(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, KVH, D] with rotary applied, and v [T, KVH, D]."""
        tokens, heads, kv_heads = hidden.shape[0], self.num_heads, self.num_kv_heads
        if self.qkv_proj is None:
            q = self.q_proj(hidden).view(tokens, heads, self.head_dim)
            k = self.k_proj(hidden).view(tokens, kv_heads, self.head_dim)
            v = self.v_proj(hidden).view(tokens, kv_heads, self.head_dim)
        else:
            qkv = self.qkv_proj(hidden).view(tokens, heads + 2 * kv_heads, self.head_dim)
            if self.q_norm is None and self.rotary:
                # q and k side by side in the GEMM's output: one rotary over both.
                qk = apply_rotary(qkv[:, : heads + kv_heads], cos, sin)
                return qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
            q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        out = self.attn(*self.rotated_qkv(hidden, cos, sin))
        return self.o_proj(out.reshape(hidden.shape[0], self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.gate_up_proj: nn.Module | None = None
        """gate and up stacked into one linear by :meth:`fuse_projections` (then the two are gone)."""
        self.act = gated_activation(config.hidden_act)

    def fuse_projections(self) -> bool:
        if self.gate_up_proj is None:
            self.gate_up_proj = _stacked_linear(self, ("gate_proj", "up_proj"))
        return self.gate_up_proj is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate, up))


def _stacked_linear(owner: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    """The named linears of ``owner`` stacked into one; they are deleted (their memory goes with them).
    None, and nothing changes, where they cannot be stacked."""
    stacked = stack_linears([getattr(owner, name) for name in names])
    if stacked is not None:
        for name in names:
            delattr(owner, name)
    return stacked


Rope = tuple[torch.Tensor, torch.Tensor]
DecodeKernel = Callable[[torch.Tensor, Rope, Rope], torch.Tensor | None]
"""(hidden, (cos, sin), the local layers' (cos, sin)) -> the decoder layers' output, or None where the
kernel does not apply to the step."""


class LlamaDecoderLayer(nn.Module):
    # Variants (BitNet) swap the blocks through these attributes; the layer's wiring stays one piece of code.
    attention_cls: type[LlamaAttention] = LlamaAttention
    mlp_cls: type[LlamaMLP] = LlamaMLP

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn: LlamaAttention = self.attention_cls(config)
        self.mlp: LlamaMLP = self.mlp_cls(config)
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
        for index in config.nope_layers:
            attention = self.layers[index].get_submodule("self_attn")
            assert isinstance(attention, LlamaAttention)
            attention.rotary = False
        for index in config.sliding_layers:
            attention = self.layers[index].get_submodule("self_attn")
            assert isinstance(attention, LlamaAttention)
            attention.attn.window = config.sliding_window
        self.embedding_scale = config.embedding_scale
        rotary_dim = config.rotary_dim or config.head_dim
        self.rotary_emb = RotaryEmbedding(
            rotary_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            config.rope_freq_factors,
        )
        self.local_layers = frozenset(config.sliding_layers if config.rope_local_theta is not None else ())
        """Layers that take ``local_rotary_emb`` (Gemma 3's sliding layers: their own base, no scaling)."""
        self.local_rotary_emb = RotaryEmbedding(
            rotary_dim, config.max_position_embeddings, config.rope_local_theta or config.rope_theta, None
        )
        self.decode_kernel: DecodeKernel | None = None
        """Set on the float32 CPU fast path: every layer in one C call for a step of decode rows only
        (``engine/models/llama_decode_kernel.py``); it returns None for other steps."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        dtype = hidden.dtype
        if self.embedding_scale != 1.0:
            # As transformers: the scale rounded to the model's dtype first.
            hidden = hidden * torch.tensor(self.embedding_scale, dtype=dtype)
        cos, sin = self.rotary_emb(positions, dtype)
        if dtype == torch.bfloat16:
            # The residual stream in float32: 30 layers of bf16 additions lose enough to flip near-tied
            # greedy choices. Norms hand the layers bf16 again, so the GEMMs stay bf16.
            hidden = hidden.float()
        local = self.local_rotary_emb(positions, dtype) if self.local_layers else (cos, sin)
        kernel = self.decode_kernel
        if kernel is not None and (out := kernel(hidden, (cos, sin), local)) is not None:
            return self.norm(out)
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, *(local if index in self.local_layers else (cos, sin)))
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    model_cls: type[LlamaModel] = LlamaModel

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model: LlamaModel = self.model_cls(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head with the embedding when the config says so (again after `to_empty`, which unties)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse_projections(self) -> int:
        """Stack q/k/v and gate/up of every layer into one linear each (fewer, larger GEMMs per step).
        For serving only: the state dict no longer has Hugging Face's names. Returns how many were fused."""
        blocks = [m for m in self.modules() if isinstance(m, LlamaAttention | LlamaMLP)]
        return sum(block.fuse_projections() for block in blocks)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden_size]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size] (soft-capped where the config says)."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
