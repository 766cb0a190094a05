"""Llama 1-3.x and Mistral: the plain decoder every other family is described against.

llama.cpp's converter permutes q/k for its interleaved-pair rope and, for Llama 3.1's rope scaling,
writes a ``rope_freqs`` tensor of per-pair divisors (read into ``ModelConfig.rope_freq_factors``).
"""

from engine.families.spec import Family

FAMILY = Family(
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    gguf_architecture="llama",
    gguf_qk_permuted=True,
)
