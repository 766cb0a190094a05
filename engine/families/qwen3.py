"""Qwen3 (dense): a per-head RMSNorm on q and on k before rotary, head_dim its own key (not
hidden / heads), no q/k/v bias unless ``attention_bias``; NEOX rope in GGUF (no q/k permutation)."""

from engine.families.spec import Family

FAMILY = Family(
    hf_architectures=("Qwen3ForCausalLM",),
    gguf_architecture="qwen3",
    qk_norm=True,
    gguf_layer_tensors={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
)
