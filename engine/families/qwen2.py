"""Qwen2 / Qwen2.5: Llama with a bias on q, k and v (always) and none on o; NEOX rope in GGUF (no
q/k permutation)."""

from engine.families.spec import Family

FAMILY = Family(
    hf_architectures=("Qwen2ForCausalLM",),
    gguf_architecture="qwen2",
    qkv_bias=lambda config: True,
    o_bias=lambda config: False,
)
