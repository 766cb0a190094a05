"""A random-weight BitNet b1.58 checkpoint of bitnet-b1.58-2B-4T's shapes as a Hugging Face directory.

    python -m bench.engine.make_bitnet_hf --out /tmp/gguf/bitnet-2b4t-random-hf

The layout is microsoft/bitnet-b1.58-2B-4T's, which transformers' ``BitNetForCausalLM`` reads and
``tern engine --model <dir>`` loads straight into the ternary C kernels: ``config.json`` with
``architectures: [BitNetForCausalLM]`` and ``quantization_config: {quant_method: bitnet}``; each linear
``weight`` packed four ternary values a byte (uint8 ``[N/4, K]``, transformers' ``pack_weights``) with a
bfloat16 ``weight_scale`` of one element that the layer divides by; embeddings and norms in bfloat16,
embeddings tied. Weights as BitNet trains them: each linear a Gaussian latent weight made ternary with
its absmean (``values = round(w / mean|w|)`` clamped to [-1, 1], one scale a tensor). The vocabulary,
tokenizer and chat template are the default model's (49,152 tokens, as ``make_bitnet_gguf``), so that
the bench clients tokenize as usual. ``bench/engine/bitnet_hf_to_tq2_0.sh`` turns it into llama.cpp's
TQ2_0 with llama.cpp's own converter and ``llama-quantize``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import BitNetConfig
from transformers.integrations.bitnet import pack_weights

from bench.engine.make_bitnet_gguf import FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, default_gguf, linear_shapes
from engine.loader import load_config, load_tokenizer
from engine.loader.save import write_tokenizer

LATENT_STD = 0.02
HF_LINEARS = {  # GGUF role -> transformers' module name in a layer
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def absmean_ternary(rng: np.random.Generator, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed uint8 ``[rows/4, columns]`` and the bfloat16 ``weight_scale`` (1 / absmean) of one linear."""
    latent = rng.standard_normal((rows, columns), dtype=np.float32) * np.float32(LATENT_STD)
    scale = max(float(np.abs(latent).mean()), 1e-5)
    values = np.clip(np.rint(latent / np.float32(scale)), -1, 1).astype(np.int8)
    return pack_weights(torch.from_numpy(values)), torch.tensor([1.0 / scale], dtype=torch.bfloat16)


def bitnet_config(
    vocab: int, bos: int | None, eos: int, layers: int, hidden: int, ffn: int
) -> dict[str, object]:
    config = BitNetConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        hidden_act="relu2",
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    config.architectures = ["BitNetForCausalLM"]
    config.quantization_config = {  # what microsoft/bitnet-b1.58-2B-4T's config.json says
        "quant_method": "bitnet",
        "linear_class": "autobitlinear",
        "quantization_mode": "offline",
    }
    return {**config.to_dict(), "torch_dtype": "bfloat16"}


def write_bitnet_hf(
    out: Path, *, layers: int = LAYERS, hidden: int = HIDDEN, ffn: int = FFN, seed: int = 0
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    source = default_gguf()
    tokenizer, source_config = load_tokenizer(source), load_config(source)
    write_tokenizer(out, source_config, tokenizer)
    vocab = source_config.vocab_size
    config = bitnet_config(
        vocab, source_config.bos_token_id, source_config.eos_token_ids[0], layers, hidden, ffn
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    rng = np.random.default_rng(seed)
    embedding = rng.standard_normal((vocab, hidden), dtype=np.float32) * np.float32(LATENT_STD)
    tensors = {
        "model.embed_tokens.weight": torch.from_numpy(embedding).bfloat16(),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        for norm, width in (
            ("input_layernorm", hidden),
            ("post_attention_layernorm", hidden),
            ("self_attn.attn_sub_norm", hidden),
            ("mlp.ffn_sub_norm", ffn),
        ):
            tensors[prefix + norm + ".weight"] = torch.ones(width, dtype=torch.bfloat16)
        for role, (rows, columns) in linear_shapes(hidden, ffn).items():
            packed, weight_scale = absmean_ternary(rng, rows, columns)
            name = HF_LINEARS[role]
            tensors[prefix + name + ".weight"] = packed
            tensors[prefix + name + ".weight_scale"] = weight_scale
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_bitnet_hf(args.out, layers=args.layers, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
