"""Random-weight Llama GGUFs of real shapes, for speed figures on a machine without the models.

    python -m bench.engine.random_gguf --shape llama-3.2-1b --tokenizer-from tok.gguf --out r1b.gguf
    python -m bench.engine.random_gguf --tokenizer-only --out tok.gguf        # the default model's vocab

Weights are F16 Gaussians (std 0.02): the values do not matter to speed, and the engine quantizes
them at load with ``--quant int4|bitnet``. The tokenizer and chat template come from a real GGUF
(default: the default model's), so prompts tokenize as usual. ``--tokenizer-only`` writes just that
vocabulary (a few MB), which is what a GPU machine without network needs carried: the default
model's file (98 MB) is over what travels (bench/engine/cuda_check.sh).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

SHAPES = {
    "llama-3.2-1b": (2048, 16, 32, 8, 8192),
    "smollm2-135m": (576, 30, 9, 3, 1536),
}
"""hidden, layers, heads, KV heads, FFN."""


def _copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> int:
    """The reader's tokenizer and chat template into the writer; returns the vocabulary size."""

    def field(name: str) -> object:
        return reader.fields[name].contents()

    tokens = field("tokenizer.ggml.tokens")
    writer.add_tokenizer_model(str(field("tokenizer.ggml.model")))
    writer.add_tokenizer_pre(str(field("tokenizer.ggml.pre")))
    writer.add_token_list(tokens)  # type: ignore[arg-type]
    writer.add_token_types(field("tokenizer.ggml.token_type"))  # type: ignore[arg-type]
    writer.add_token_merges(field("tokenizer.ggml.merges"))  # type: ignore[arg-type]
    writer.add_chat_template(str(field("tokenizer.chat_template")))
    writer.add_bos_token_id(int(field("tokenizer.ggml.bos_token_id")))  # type: ignore[call-overload]
    writer.add_eos_token_id(int(field("tokenizer.ggml.eos_token_id")))  # type: ignore[call-overload]
    writer.add_add_bos_token(bool(field("tokenizer.ggml.add_bos_token")))
    return len(tokens)  # type: ignore[arg-type]


def write(
    out: Path, tokenizer_from: Path, shape: tuple[int, int, int, int, int] | None, seed: int = 0
) -> None:
    """A random model of ``shape`` (None: a tokenizer-only file) with ``tokenizer_from``'s vocabulary."""
    writer = gguf.GGUFWriter(str(out), "llama")
    vocab = _copy_tokenizer(gguf.GGUFReader(str(tokenizer_from)), writer)
    if shape is not None:
        _add_weights(writer, vocab, shape, seed)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_weights(
    writer: gguf.GGUFWriter, vocab: int, shape: tuple[int, int, int, int, int], seed: int
) -> None:
    hidden, layers, heads, kv_heads, ffn = shape
    dim = hidden // heads
    writer.add_name(f"random-{hidden}x{layers}")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(dim)
    writer.add_file_type(1)
    rng = np.random.default_rng(seed)

    def rnd(*s: int) -> np.ndarray:
        return (rng.standard_normal(s, dtype=np.float32) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", rnd(vocab, hidden))  # tied: no output.weight
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(p + "attn_q.weight", rnd(heads * dim, hidden))
        writer.add_tensor(p + "attn_k.weight", rnd(kv_heads * dim, hidden))
        writer.add_tensor(p + "attn_v.weight", rnd(kv_heads * dim, hidden))
        writer.add_tensor(p + "attn_output.weight", rnd(hidden, heads * dim))
        writer.add_tensor(p + "ffn_gate.weight", rnd(ffn, hidden))
        writer.add_tensor(p + "ffn_up.weight", rnd(ffn, hidden))
        writer.add_tensor(p + "ffn_down.weight", rnd(hidden, ffn))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", choices=SHAPES, default="llama-3.2-1b")
    p.add_argument("--tokenizer-only", action="store_true", help="write the vocabulary alone")
    p.add_argument("--tokenizer-from", type=Path, help="a GGUF with a tokenizer (default: the default model)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.tokenizer_from is None:
        from engine.loader.load import default_model_path

        args.tokenizer_from = default_model_path()
    write(args.out, args.tokenizer_from, None if args.tokenizer_only else SHAPES[args.shape], args.seed)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
