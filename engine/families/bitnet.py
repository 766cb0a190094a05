"""BitNet b1.58: squared ReLU in transformers' model, SiLU as llama.cpp's ``bitnet`` graph computes a
GGUF of it (whose metadata names no activation); sub-norms before o_proj and down_proj."""

from engine.families.spec import Family

FAMILY = Family(
    hf_architectures=("BitNetForCausalLM",),
    gguf_architecture="bitnet",
    hidden_acts=("relu2", "silu"),
    gguf_layer_tensors={"attn_sub_norm": "self_attn.attn_sub_norm", "ffn_sub_norm": "mlp.ffn_sub_norm"},
    model="bitnet",
)
