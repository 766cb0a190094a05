"""Llama 3.x (rope_freqs), Qwen3 (q/k norm, own head_dim), SmolLM3 (NoPE layers, YaRN) and Gemma 3
(sandwich norms stored as 1 + w, GeGLU, sliding-window layers with their own rope base) from GGUF
files as llama.cpp's converter writes them (tests/engine/families_gguf.py), float32, against
transformers on the same random weights: the paged path's logits, greedy tokens through the engine,
and the GPU path's decode attention (Triton, interpreted on CPU). Their Hugging Face directories are
checked by tests/engine/test_parity_hf.py (TINY_VARIANTS "llama3", "qwen3", "smollm3")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.layers.attention import set_decode_backend
from engine.layers.attention_backends import TorchDecode, TritonDecode
from engine.loader import LoadedModel, load_model
from engine.loader.save import hf_config_dict
from engine.model_config import ModelConfig
from engine.tokenizer import Tokenizer
from tests.engine.families_gguf import FAMILY_VARIANTS, head_dim, tiny_family_model, write_family_gguf
from tests.engine.test_loader_gguf import BYTE_TOKENS
from tests.engine.test_parity_hf import LOGIT_TOLERANCE, engine_greedy, hf_greedy, hf_logits, paged_logits

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away 🏰, there lived",
]


@pytest.fixture(scope="module", params=sorted(FAMILY_VARIANTS))
def family_pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[LoadedModel, Any]:
    architecture = request.param
    hf_model = tiny_family_model(architecture)
    path = write_family_gguf(
        hf_model, architecture, tmp_path_factory.mktemp("family") / f"tiny-{architecture}.gguf"
    )
    return load_model(path, progress=False), hf_model


def test_the_gguf_describes_the_family(family_pair: tuple[LoadedModel, Any]) -> None:
    """Each file really carries what its family is named for (guards the writer and the reader)."""
    loaded, hf_model = family_pair
    config, hf = loaded.config, hf_model.config
    assert config.architecture == type(hf_model).__name__
    assert (config.head_dim, config.tie_word_embeddings) == (head_dim(hf), hf.tie_word_embeddings)
    if config.architecture == "LlamaForCausalLM":  # llama3 scaling as the rope_freqs tensor
        assert config.rope_scaling is None and config.rope_freq_factors is not None
        assert len(set(config.rope_freq_factors)) > 2  # all three bands
    if config.architecture == "Qwen3ForCausalLM":
        assert config.qk_norm and config.head_dim * config.num_attention_heads != config.hidden_size
    if config.architecture == "SmolLM3ForCausalLM":
        assert config.nope_layers == (3,)
        assert config.rope_scaling == {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        }
    if config.architecture == "Phi3ForCausalLM":  # LongRoPE's tensors, partial rotary
        assert config.rotary_dim == 12 and config.rope_scaling is not None
        assert config.rope_scaling["long_factor"] == tuple(hf.rope_parameters["long_factor"])
        assert (
            max(len(p.encode()) for p in PROMPTS) < 64 < max(len(p.encode()) for p in PROMPTS) + GREEDY_TOKENS
        )
    if config.architecture == "Gemma3ForCausalLM":  # the window shorter than every prompt; layer 5 global
        assert (config.sliding_window, config.sliding_layers) == (hf.sliding_window, (0, 1, 2, 3, 4))
        assert (config.rope_local_theta, config.final_logit_softcap) == (10000.0, 30.0)
        assert config.sliding_window < min(len(p.encode()) for p in PROMPTS)


def test_logits_and_greedy_tokens_equal_transformers(family_pair: tuple[LoadedModel, Any]) -> None:
    loaded, hf_model = family_pair
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    for ids in prompts:
        diff = (paged_logits(loaded.model, ids) - hf_logits(hf_model, ids)).abs().max().item()
        assert diff <= LOGIT_TOLERANCE, f"max |logit diff| {diff:.2e} on {len(ids)} tokens"
    ours = engine_greedy(loaded, prompts, GREEDY_TOKENS)
    assert ours == [hf_greedy(hf_model, ids, GREEDY_TOKENS) for ids in prompts]


def test_the_gpu_paths_decode_attention_equals_transformers(family_pair: tuple[LoadedModel, Any]) -> None:
    """The CUDA path's layers with its Triton decode attention (interpreted on CPU): the decode steps
    of a paged run through the Triton kernel, against transformers."""
    loaded, hf_model = family_pair
    ids = loaded.tokenizer.encode(PROMPTS[0])
    set_decode_backend(loaded.model, TritonDecode())
    try:
        ours = paged_logits(loaded.model, ids, decode_tail=3)
    finally:
        set_decode_backend(loaded.model, TorchDecode())
    diff = (ours - hf_logits(hf_model, ids)).abs().max().item()
    assert diff <= LOGIT_TOLERANCE


def test_the_config_round_trips_through_a_hugging_face_config(family_pair: tuple[LoadedModel, Any]) -> None:
    """What ``tern quantize`` writes for a GGUF source reads back to the same config; a rope_freqs
    tensor, which no transformers config can carry, is refused rather than dropped."""
    config = family_pair[0].config
    if config.rope_freq_factors is not None:
        with pytest.raises(ValueError, match="rope_freqs"):
            hf_config_dict(config)
        return
    assert ModelConfig.from_hf_dict(hf_config_dict(config)) == config


def test_transformers_reads_the_written_config_as_the_same_model(
    family_pair: tuple[LoadedModel, Any], tmp_path: Path
) -> None:
    """transformers builds the model the written config.json describes (Gemma 3's layer types,
    window, local rope base, query scalar and soft-cap; Phi-3's LongRoPE and partial rotary): with
    the source's weights, its greedy tokens are the source's."""
    import transformers

    loaded, hf_model = family_pair
    if loaded.config.rope_freq_factors is not None:
        pytest.skip("a rope_freqs tensor has no config.json form (refused above)")
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(loaded.config)))
    rebuilt = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    rebuilt.load_state_dict(hf_model.state_dict())
    rebuilt.eval()
    ids = loaded.tokenizer.encode(PROMPTS[2])
    assert type(rebuilt) is type(hf_model)
    assert hf_greedy(rebuilt, ids, GREEDY_TOKENS) == hf_greedy(hf_model, ids, GREEDY_TOKENS)


def _llama3_vocabulary_metadata() -> dict[str, Any]:
    tokens = [*BYTE_TOKENS, "<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]
    return {
        "general.architecture": "llama",
        "llama.embedding_length": 64,
        "llama.attention.head_count": 4,
        "llama.feed_forward_length": 128,
        "llama.block_count": 2,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * len(BYTE_TOKENS) + [3] * 4,
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.eos_token_id": tokens.index("<|eot_id|>"),
    }


def test_every_llama3_end_token_stops_generation() -> None:
    """A Llama 3 GGUF names one eos; <|eot_id|>, <|eom_id|> and <|end_of_text|> all end a turn (as
    generation_config.json lists them, and llama.cpp finds them by their text)."""
    metadata = _llama3_vocabulary_metadata()
    tokens = metadata["tokenizer.ggml.tokens"]
    config = ModelConfig.from_gguf_metadata(metadata, {"token_embd.weight"})
    expected = {tokens.index(t) for t in ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")}
    assert set(config.eos_token_ids) == expected and config.eos_token_ids[0] == tokens.index("<|eot_id|>")
    # the engine stops on the tokenizer's eos ids (engine/core/assembly.py), which the loader builds so
    tokenizer = Tokenizer.from_gguf_metadata(metadata, eos_token_ids=config.eos_token_ids)
    assert set(tokenizer.eos_token_ids) == expected
    metadata["tokenizer.ggml.eom_token_id"] = tokens.index("<|eom_id|>")  # a key, where a file has one
    assert set(ModelConfig.from_gguf_metadata(metadata, {"token_embd.weight"}).eos_token_ids) == expected


def test_generation_config_eos_list_is_every_stop_id(tmp_path: Path) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 300,
        "eos_token_id": 128001,
    }
    assert ModelConfig.from_hf_dict(config, {"eos_token_id": [128001, 128008, 128009]}).eos_token_ids == (
        128001,
        128008,
        128009,
    )


def test_a_rope_freqs_tensor_needs_its_values() -> None:
    with pytest.raises(ValueError, match="rope_freqs"):
        ModelConfig.from_gguf_metadata(
            _llama3_vocabulary_metadata(), {"token_embd.weight", "rope_freqs.weight"}
        )


def test_a_prompt_past_longropes_original_context_in_chunks_gives_transformers_tokens(tmp_path: Path) -> None:
    """Phi-3: transformers computes a prompt in one forward, on the long factors when it runs past the
    original context; the engine prefills it in chunks (64 tokens a step here), each on the choice
    of the whole prompt, so the tokens are the same."""
    hf_model = tiny_family_model("phi3")
    loaded = load_model(write_family_gguf(hf_model, "phi3", tmp_path / "tiny-phi3.gguf"), progress=False)
    ids = loaded.tokenizer.encode(" ".join(PROMPTS))
    assert len(ids) > 64 + 36  # past the original context, and more than one 64-token chunk
    assert engine_greedy(loaded, [ids], GREEDY_TOKENS) == [hf_greedy(hf_model, ids, GREEDY_TOKENS)]


@pytest.mark.parametrize(
    ("variant", "architecture"), [("gemma3_layer_types", "Gemma3ForCausalLM"), ("phi3", "Phi3ForCausalLM")]
)
def test_a_hugging_face_config_round_trips_with_its_layer_types_and_longrope(
    variant: str, architecture: str, tmp_path: Path
) -> None:
    """A config read from config.json (Gemma 3 with its own layer_types and query scalar 24; Phi-3's
    LongRoPE) is written back as one transformers builds the same model from."""
    import torch
    import transformers

    from tests.engine.conftest import TINY_COMMON, TINY_VARIANTS, randomize_norms

    config_class, overrides = TINY_VARIANTS[variant]
    source = getattr(transformers, config_class)(
        **{**TINY_COMMON, **overrides, "vocab_size": len(BYTE_TOKENS)}
    )
    ours = ModelConfig.from_hf_dict({**source.to_dict(), "architectures": [architecture]})
    written = hf_config_dict(ours)
    assert ModelConfig.from_hf_dict(written) == ours
    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(source).eval()
    randomize_norms(original)
    (tmp_path / "config.json").write_text(json.dumps(written))
    rebuilt = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    rebuilt.load_state_dict(original.state_dict())
    ids = [5, 80, 120, 33, 7, 200, 64, 9, 150, 42] * 8  # past Gemma's window and Phi-3's original context
    assert hf_greedy(rebuilt.eval(), ids, 8) == hf_greedy(original, ids, 8)
