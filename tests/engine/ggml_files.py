"""Small random-weight Llama GGUFs of mixed types (a Q4_K_M file's mix and others) for the kernels' and
the loader's tests, of random blocks (``ggml_kernels.random_blocks``: gguf cannot quantize to K-quants)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from engine.cpu.ggml_kernels import random_blocks
from tests.engine.test_loader_gguf import BYTE_TOKENS, add_byte_tokenizer, add_llama_hyperparameters

__all__ = ["MIXED_TYPES", "Q", "random_blocks", "write_mixed_gguf"]

Q = gguf.GGMLQuantizationType
# A Q4_K_M file's mix (v and down in Q6_K), plus the other types with a kernel; 2 layers.
MIXED_TYPES = {
    "attn_q": Q.Q4_K,
    "attn_k": Q.Q4_K,
    "attn_v": Q.Q6_K,
    "attn_output": Q.Q5_K,
    "ffn_gate": Q.Q8_0,
    "ffn_up": Q.Q5_0,
    "ffn_down": Q.Q6_K,
}
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2


def write_mixed_gguf(path: Path, types: dict[str, Q], embedding: Q, output: Q | None, seed: int = 0) -> Path:
    """A random Llama GGUF whose linears have ``types`` (per role, every layer), the embedding
    ``embedding`` and the output head ``output`` (None: tied to the embedding)."""
    generator = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("mixed")
    add_llama_hyperparameters(
        writer,
        layers=LAYERS,
        context=512,
        hidden=HIDDEN,
        ffn=FFN,
        heads=HEADS,
        kv_heads=KV_HEADS,
        vocab=len(BYTE_TOKENS),
    )
    add_byte_tokenizer(writer)
    shapes = {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (HIDDEN // HEADS * KV_HEADS, HIDDEN),
        "attn_v": (HIDDEN // HEADS * KV_HEADS, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }

    def add(name: str, ggml_type: Q, rows: int, width: int, scale: float = 1.0) -> None:
        seed_here = int(generator.integers(1 << 30))
        writer.add_tensor(name, random_blocks(ggml_type, rows, width, seed_here, scale), raw_dtype=ggml_type)

    add("token_embd.weight", embedding, len(BYTE_TOKENS), HIDDEN, scale=16.0)
    for layer in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(HIDDEN, dtype=np.float32))
        for role, (rows, width) in shapes.items():
            add(f"blk.{layer}.{role}.weight", types[role], rows, width)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    if output is not None:
        add("output.weight", output, len(BYTE_TOKENS), HIDDEN, scale=16.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
