"""Our model and engine against Hugging Face transformers on the same weights (float32, CPU).

Logits go through the real paged-KV path (chunked prefill, then one-token decode steps) and are
compared with transformers' full forward. Greedy generations go through `LLMEngine` and are
compared with transformers' own cached greedy loop.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.layers.attention import Attention
from engine.layers.context import make_context, reset_context, set_context
from engine.loader import LoadedModel, load_model
from engine.serving.frames import generate_frames
from protocol.rpc import DeltaFrame, GenerateRequest, SamplingParams
from tests.engine.conftest import TINY_VARIANTS

LOGIT_TOLERANCE = 1e-3
GREEDY_TOKENS = 64
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away 🏰, there lived",
]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread: on a shared 2-core machine, two threads spin-wait each other ~15x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- our side ------------------------------------------------------------------------------------


@torch.inference_mode()
def paged_logits(
    model: nn.Module, ids: list[int], *, block_size: int = 4, chunk: int = 7, decode_tail: int = 4
) -> torch.Tensor:
    """Logits [len(ids), V]: prefilled in chunks, then the last `decode_tail` tokens one per step."""
    config = model.config
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    num_blocks = -(-len(ids) // block_size)
    shape = (2, len(layers), num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    cache = torch.zeros(shape, dtype=next(model.parameters()).dtype)
    saved = [(layer.k_cache, layer.v_cache) for layer in layers]
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
    # Blocks in reverse order, so a table that is ignored or misread cannot pass by accident.
    table = list(reversed(range(num_blocks)))
    logits, start = [], 0
    try:
        while start < len(ids):
            prefill_end = len(ids) - decode_tail
            end = min(start + chunk, prefill_end) if start < prefill_end else start + 1
            positions = list(range(start, end))
            slots = [table[p // block_size] * block_size + p % block_size for p in positions]
            set_context(
                make_context(
                    query_lens=[end - start], context_lens=[end], block_tables=[table], slot_mapping=slots
                )
            )
            hidden = model(torch.tensor(ids[start:end]), torch.tensor(positions))
            logits.append(model.compute_logits(hidden))
            start = end
    finally:
        reset_context()
        for layer, (k, v) in zip(layers, saved, strict=True):
            layer.k_cache, layer.v_cache = k, v
    return torch.cat(logits)


def engine_greedy(loaded: LoadedModel, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Greedy tokens from `LLMEngine`, all prompts in one batch."""
    engine = LLMEngine(
        EngineConfig(device="cpu", block_size=16, num_kv_blocks=64, max_num_batched_tokens=64, num_threads=1),
        model=loaded.model,
        tokenizer=loaded.tokenizer,
        model_config=loaded.config,
        model_name=loaded.name,
    )
    sampling = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    requests = [
        GenerateRequest(request_id=str(i), prompt=p, sampling=sampling) for i, p in enumerate(prompts)
    ]
    frames = generate_frames(engine, requests)
    return [
        [t for f in frames[str(i)] if isinstance(f, DeltaFrame) for t in f.token_ids]
        for i in range(len(prompts))
    ]


# -- transformers' side --------------------------------------------------------------------------


@torch.inference_mode()
def hf_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy(hf_model: Any, ids: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding with transformers' KV cache, never stopping at eos (like ignore_eos)."""
    out = hf_model(torch.tensor([ids]), use_cache=True)
    tokens: list[int] = []
    for _ in range(num_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = hf_model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def assert_model_matches(
    loaded: LoadedModel, hf_model: Any, prompts: list[list[int]], greedy_prompts: list[list[int]]
) -> None:
    for ids in prompts:
        diff = (paged_logits(loaded.model, ids) - hf_logits(hf_model, ids)).abs().max().item()
        assert diff <= LOGIT_TOLERANCE, f"max |logit diff| {diff:.2e} on {len(ids)} tokens"
    ours = engine_greedy(loaded, greedy_prompts, GREEDY_TOKENS)
    assert ours == [hf_greedy(hf_model, ids, GREEDY_TOKENS) for ids in greedy_prompts]


# -- tiny random-weight architectures ------------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(TINY_VARIANTS))
def tiny_pair(
    request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]
) -> tuple[LoadedModel, Any]:
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(request.param)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return load_model(path, device="cpu", dtype=torch.float32, progress=False), hf_model


def test_tiny_models_match_transformers(tiny_pair: tuple[LoadedModel, Any]) -> None:
    loaded, hf_model = tiny_pair
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    assert_model_matches(loaded, hf_model, prompts, greedy_prompts=prompts[:2])


def test_tiny_variants_cover_the_features(tiny_pair: tuple[LoadedModel, Any]) -> None:
    """Each variant really exercises what it is named for (guards the fixtures themselves)."""
    loaded, _ = tiny_pair
    config = loaded.config
    if config.architecture == "Qwen2ForCausalLM":
        assert config.attention_bias and not config.attention_out_bias
        assert (Path(loaded.path) / "model.safetensors.index.json").exists()
    if config.rope_scaling is not None:
        expected = {"SmolLM3ForCausalLM": "yarn", "Phi3ForCausalLM": "longrope"}.get(
            config.architecture, "llama3"
        )
        assert config.rope_scaling["rope_type"] == expected
    if config.architecture == "Phi3ForCausalLM":  # partial rotary, both LongRoPE factor sets in play
        assert config.rotary_dim == 12 < config.head_dim and config.rope_scaling is not None
        assert config.rope_scaling["original_max_position_embeddings"] == 64
        assert config.rope_scaling["attention_factor"] > 1.0
    if config.architecture == "Qwen3ForCausalLM":
        assert config.qk_norm and config.head_dim * config.num_attention_heads != config.hidden_size
    if config.architecture == "SmolLM3ForCausalLM":
        assert config.nope_layers == (3,) and not loaded.model.model.layers[3].self_attn.rotary
    if config.architecture == "Gemma3ForCausalLM":  # windows shorter than the prompts, one global layer
        assert config.sliding_window == 6 and config.final_logit_softcap == 30.0
        assert 0 < len(config.sliding_layers) < config.num_hidden_layers
        assert config.rope_local_theta == 10000.0 and config.rope_theta == 1000000.0
    if config.tie_word_embeddings:
        assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    if config.tie_word_embeddings and config.architecture == "LlamaForCausalLM":
        assert config.num_key_value_heads == 1 < config.num_attention_heads


# -- the default model: SmolLM2-135M-Instruct Q4_1 GGUF -----------------------------------------


@pytest.fixture(scope="module")
def hf_default_model(default_gguf_path: Path, hf_gguf_config: Any) -> Iterator[Any]:
    """transformers' model from the same GGUF, using its own dequantization and q/k un-permute.

    `from_pretrained(gguf_file=...)` requires `accelerate`, which this project does not install;
    this is the same conversion without it.
    """
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_gguf_config), dtype=torch.float32)
    tensors = load_gguf_checkpoint(default_gguf_path, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    assert result.unexpected_keys == [] and set(result.missing_keys) <= {"lm_head.weight"}
    model.tie_weights()
    yield model.eval()


@pytest.mark.slow
def test_default_gguf_matches_transformers(default_model: LoadedModel, hf_default_model: Any) -> None:
    tokenizer = default_model.tokenizer
    chat = tokenizer.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}])
    prompts = [tokenizer.encode(PROMPTS[0]), chat]
    assert_model_matches(default_model, hf_default_model, prompts, greedy_prompts=[chat])


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france(default_model: LoadedModel) -> None:
    chat = GenerateRequest(
        request_id="paris",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        sampling=SamplingParams(temperature=0.0, max_tokens=24),
    )
    engine = LLMEngine(
        EngineConfig(device="cpu", num_kv_blocks=32, num_threads=1),
        model=default_model.model,
        tokenizer=default_model.tokenizer,
        model_config=default_model.config,
        model_name=default_model.name,
    )
    frames = generate_frames(engine, [chat])["paris"]
    text = "".join(f.text for f in frames if isinstance(f, DeltaFrame))
    assert "Paris" in text
