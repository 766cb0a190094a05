"""GGUF loading: every supported tensor type, llama.cpp's q/k permutation, names and metadata.

Tiny random Llama and Qwen2 models are converted to GGUF here the way llama.cpp's converter does it (q/k rows
permuted, tensors quantized with gguf.quants); what we load is compared with transformers'
own GGUF conversion of the same file and with the original weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from engine.loader import LoadedModel, load_model
from engine.loader.gguf_file import hf_tensor_name, open_gguf, read_metadata, unpermute_rope_rows
from tests.engine.conftest import TINY_COMMON, TINY_VARIANTS

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


def gguf_name(hf_name: str, layer_names: dict[str, str] = HF_TO_GGUF) -> str:
    """llama.cpp's name of a HF tensor; ``layer_names`` maps a layer's module names."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{layer_names[module]}.{kind}"


# A byte-level vocabulary: the 256 byte symbols plus three control tokens.
BYTE_TOKENS = [*sorted(pre_tokenizers.ByteLevel.alphabet()), "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def add_llama_hyperparameters(
    writer: gguf.GGUFWriter,
    *,
    layers: int,
    context: int,
    hidden: int,
    ffn: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    rope_theta: float = 10000.0,
    eps: float = 1e-5,
) -> None:
    """The shape keys every test GGUF of a Llama-family model carries."""
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(vocab)


def add_byte_tokenizer(writer: gguf.GGUFWriter) -> None:
    """The byte-level vocabulary and ChatML template, as a GGUF's tokenizer keys."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(BYTE_TOKENS)
    writer.add_token_types([1] * 256 + [3] * 3)
    writer.add_token_merges([])
    writer.add_bos_token_id(BYTE_TOKENS.index("<|im_start|>"))
    writer.add_eos_token_id(BYTE_TOKENS.index("<|im_end|>"))
    writer.add_chat_template(CHATML)


def write_gguf(model: Any, architecture: str, path: Path) -> dict[str, np.ndarray]:
    """Convert an HF model to GGUF like llama.cpp's converter; returns the original weights.

    Like llama.cpp, only the "llama" architecture gets its q/k rows permuted.
    """
    config = model.config
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name(f"tiny {architecture}")
    add_llama_hyperparameters(
        writer,
        layers=config.num_hidden_layers,
        context=config.max_position_embeddings,
        hidden=config.hidden_size,
        ffn=config.intermediate_size,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        vocab=config.vocab_size,
        rope_theta=config.rope_parameters["rope_theta"],
        eps=config.rms_norm_eps,
    )
    add_byte_tokenizer(writer)
    for name, weights in state.items():
        role = gguf_name(name).split(".")[-2]
        if architecture == "llama" and role == "attn_q":
            weights = llama_cpp_permute(weights, config.num_attention_heads)
        elif architecture == "llama" and role == "attn_k":
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


# GGUF architecture -> the tiny HF variant converted to it (Qwen2 adds q/k/v biases, no permutation).
GGUF_VARIANTS = {"llama": "mistral", "qwen2": "qwen2"}


def tiny_hf_model(variant: str) -> Any:
    import transformers

    config_class, overrides = TINY_VARIANTS[variant]
    fields = {**TINY_COMMON, **overrides, "vocab_size": len(BYTE_TOKENS)}
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**fields))


@pytest.fixture(scope="module", params=sorted(GGUF_VARIANTS))
def tiny_gguf(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, np.ndarray]]:
    architecture = request.param
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{architecture}.Q4_1.gguf"
    return path, write_gguf(tiny_hf_model(GGUF_VARIANTS[architecture]), architecture, path)


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


def test_loaded_gguf_config_and_name(
    tiny_gguf: tuple[Path, dict[str, np.ndarray]], loaded: LoadedModel
) -> None:
    architecture = tiny_gguf[0].name.split(".")[0].removeprefix("tiny-")
    hf = tiny_hf_model(GGUF_VARIANTS[architecture]).config
    assert loaded.name == f"tiny-{architecture}"
    expected_class = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[architecture]
    assert loaded.config.architecture == expected_class
    assert loaded.config.attention_bias == (architecture == "qwen2")
    assert loaded.config.rope_theta == hf.rope_parameters["rope_theta"]
    assert not loaded.config.tie_word_embeddings
    assert (loaded.config.num_attention_heads, loaded.config.num_key_value_heads) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
    )
    assert loaded.tokenizer.eos_token_ids == (BYTE_TOKENS.index("<|im_end|>"),)
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": "hi é"}])
    assert (
        loaded.tokenizer.decode(ids, skip_special_tokens=False)
        == "<|im_start|>user\nhi é<|im_end|>\n<|im_start|>assistant\n"
    )


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


def test_unsupported_tokenizer_is_refused(tiny_gguf: tuple[Path, dict[str, np.ndarray]]) -> None:
    from engine.tokenizer import Tokenizer

    metadata: dict[str, Any] = dict(read_metadata(open_gguf(tiny_gguf[0])))
    metadata["tokenizer.ggml.model"] = "t5"  # Unigram: no family the engine runs has one
    with pytest.raises(
        ValueError, match=r"GGUF tokenizer 't5' is not supported; supported: 'gpt2' .* 'llama'"
    ):
        Tokenizer.from_gguf_metadata(metadata)
