"""GGUF loading: every supported tensor type, llama.cpp's q/k permutation, names and metadata.

A tiny random Llama is converted to GGUF here the way llama.cpp's converter does it (q/k rows
permuted, tensors quantized with gguf.quants); what we load is compared with transformers'
own GGUF conversion of the same file and with the original weights.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from engine.loader import LoadedModel, load_model
from engine.loader.gguf_file import hf_tensor_name, open_gguf, read_metadata, unpermute_rope_rows

Q = gguf.GGMLQuantizationType
# One type per tensor role, so every supported type is exercised in one file.
TENSOR_TYPES = {
    "token_embd": Q.Q8_0,
    "output": Q.F16,
    "attn_q": Q.Q4_0,
    "attn_k": Q.Q4_1,
    "attn_v": Q.BF16,
    "attn_output": Q.Q8_0,
    "ffn_gate": Q.Q4_1,
    "ffn_up": Q.Q4_0,
    "ffn_down": Q.F16,
}
HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    rows = weights.shape[0]
    return (
        weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"


def write_gguf(hf_dir: Path, source_gguf: Path, path: Path) -> dict[str, np.ndarray]:
    """Convert a tiny HF Llama to GGUF (tokenizer copied from `source_gguf`); returns its HF weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    state = {
        k: v.numpy()
        for k, v in AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict().items()
    }
    source = read_metadata(open_gguf(source_gguf))
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(source["tokenizer.ggml.pre"])
    writer.add_token_list(source["tokenizer.ggml.tokens"])
    writer.add_token_types(source["tokenizer.ggml.token_type"])
    writer.add_token_merges(source["tokenizer.ggml.merges"])
    writer.add_bos_token_id(source["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(source["tokenizer.ggml.eos_token_id"])
    writer.add_chat_template(source["tokenizer.chat_template"])
    for name, weights in state.items():
        role = gguf_name(name).split(".")[-2]
        if role == "attn_q":
            weights = llama_cpp_permute(weights, config.num_attention_heads)
        elif role == "attn_k":
            weights = llama_cpp_permute(weights, config.num_key_value_heads)
        qtype = TENSOR_TYPES.get(role, Q.F32) if weights.ndim == 2 else Q.F32
        data = gguf.quants.quantize(np.ascontiguousarray(weights), qtype)
        # Float arrays carry their own type; quantized ones are bytes that need it spelled out.
        raw_dtype = None if qtype in (Q.F32, Q.F16) else qtype
        writer.add_tensor(gguf_name(name), data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


@pytest.fixture(scope="module")
def tiny_gguf(
    tiny_model_dir: Callable[[str], Path], default_gguf_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q4_1.gguf"
    return path, write_gguf(tiny_model_dir("mistral"), default_gguf_path, path)


@pytest.fixture(scope="module")
def loaded(tiny_gguf: tuple[Path, dict[str, np.ndarray]]) -> LoadedModel:
    return load_model(tiny_gguf[0], progress=False)


def test_file_has_every_supported_type(tiny_gguf: tuple[Path, dict[str, np.ndarray]]) -> None:
    types = {t.tensor_type for t in open_gguf(tiny_gguf[0]).tensors}
    assert types == {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1}


def test_weights_equal_transformers_gguf_conversion(
    tiny_gguf: tuple[Path, dict[str, np.ndarray]], loaded: LoadedModel
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = tiny_gguf[0]
    hf_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path.parent, gguf_file=path.name))
    expected = load_gguf_checkpoint(path, return_tensors=True, model_to_load=hf_model)["tensors"]
    ours = loaded.model.state_dict()
    assert set(expected) == set(ours)
    for name, tensor in expected.items():
        torch.testing.assert_close(ours[name], torch.as_tensor(tensor, dtype=torch.float32), rtol=0, atol=0)


def test_weights_are_close_to_the_originals(
    tiny_gguf: tuple[Path, dict[str, np.ndarray]], loaded: LoadedModel
) -> None:
    """Dequantized and un-permuted weights sit within each format's rounding error of the source."""
    original = tiny_gguf[1]
    ours = loaded.model.state_dict()
    for name, weights in original.items():
        role = gguf_name(name).split(".")[-2]
        qtype = TENSOR_TYPES.get(role, Q.F32) if weights.ndim == 2 else Q.F32
        error = (ours[name] - torch.from_numpy(weights)).abs().max().item()
        scale = float(np.abs(weights).max())
        bound = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.1}[qtype]
        assert error <= bound * scale, (name, qtype.name, error)


def test_loaded_gguf_config_and_name(loaded: LoadedModel, tiny_model_dir: Callable[[str], Path]) -> None:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tiny_model_dir("mistral"))
    assert loaded.name == "tiny-llama"
    assert loaded.config.architecture == "LlamaForCausalLM"
    assert not loaded.config.tie_word_embeddings
    assert (loaded.config.num_attention_heads, loaded.config.num_key_value_heads) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
    )
    assert loaded.tokenizer.encode_chat([{"role": "user", "content": "hi"}])


def test_unpermute_inverts_llama_cpp_permute() -> None:
    weights = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(unpermute_rope_rows(llama_cpp_permute(weights, 8), 8), weights)
    assert not np.array_equal(llama_cpp_permute(weights, 8), weights)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output.weight", "lm_head.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("blk.12.attn_q.bias", "model.layers.12.self_attn.q_proj.bias"),
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
        ("blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
    ],
)
def test_tensor_names(name: str, expected: str) -> None:
    assert hf_tensor_name(name) == expected


def test_unknown_tensor_name_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unexpected tensor 'blk\.0\.attn_qkv\.weight'"):
        hf_tensor_name("blk.0.attn_qkv.weight")


def test_unsupported_tokenizer_is_refused(default_gguf_path: Path) -> None:
    from engine.tokenizer import Tokenizer

    metadata: dict[str, Any] = dict(read_metadata(open_gguf(default_gguf_path)))
    metadata["tokenizer.ggml.model"] = "llama"
    with pytest.raises(ValueError, match="only byte-level BPE"):
        Tokenizer.from_gguf_metadata(metadata)
