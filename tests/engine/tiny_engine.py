"""Tiny random-weight engines for fast tests: a 2-layer Llama and a byte-level tokenizer.

The byte tokenizer maps every UTF-8 byte to its own token, so multi-byte characters and
stop strings naturally straddle token boundaries. The fixtures are re-exported by
``tests/engine/conftest.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.serving.requests import engine_request
from engine.tokenizer import Tokenizer, _bytes_to_unicode
from protocol.rpc import GenerateRequest

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_BLOCKS = 128

EngineFactory = Callable[..., LLMEngine]


def make_byte_tokenizer() -> Tokenizer:
    """Token id = byte value (0..255), then <|endoftext|> (256, eos), <|im_start|>, <|im_end|>."""
    byte_chars = _bytes_to_unicode()
    backend = Backend(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return Tokenizer(backend, special_tokens={"eos_token": "<|endoftext|>"}, chat_template=CHATML_TEMPLATE)


def tiny_config(**overrides: Any) -> ModelConfig:
    """A small Llama config (byte vocabulary plus three specials); ``overrides`` replace its fields."""
    fields: dict[str, Any] = dict(
        architecture="LlamaForCausalLM",
        vocab_size=259,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attention_bias=False,
    )
    return ModelConfig(**(fields | overrides))


def make_tiny_model(seed: int = 0, **overrides: Any) -> tuple[LlamaForCausalLM, ModelConfig]:
    config = tiny_config(**overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # Zero logits for all but printable ASCII, so generated text is readable (random bytes
        # are rarely valid UTF-8) and eos is rare; prompts may still use any byte.
        printable = torch.zeros(config.vocab_size, dtype=torch.bool)
        printable[32:127] = True
        model.lm_head.weight[~printable] = 0
    return model, config


def make_tiny_engine(tokenizer: Tokenizer | None = None, **overrides: Any) -> LLMEngine:
    """An engine on the tiny model: CPU, 4-token blocks, TINY_BLOCKS blocks unless overridden."""
    model, config = make_tiny_model()
    settings: dict[str, Any] = dict(device="cpu", block_size=4, num_kv_blocks=TINY_BLOCKS)
    return LLMEngine(
        EngineConfig(**(settings | overrides)),
        model=model,
        tokenizer=tokenizer or make_byte_tokenizer(),
        model_config=config,
        model_name="tiny",
    )


def add_wire_request(engine: LLMEngine, request: GenerateRequest) -> None:
    """Queue an RPC request the way the server does: check the model and tokenise, then add."""
    engine.add_request(
        engine_request(request, engine.tokenizer, model_name=engine.model_name, grammars=engine.grammars)
    )


def blocks_held_by_requests(engine: LLMEngine) -> int:
    """KV blocks neither free nor merely kept by the prefix cache (which gives them back on demand)."""
    manager = engine.block_manager
    return manager.num_blocks - manager.num_free_blocks - manager.num_reclaimable_blocks()


def assert_every_block_comes_back(engine: LLMEngine) -> None:
    """No request holds a block, and once the prefix cache lets go every block is free with no reference."""
    manager = engine.block_manager
    assert blocks_held_by_requests(engine) == 0
    manager._reclaim(manager.num_reclaimable_blocks())
    assert manager.num_free_blocks == manager.num_blocks
    assert all(manager.allocator.refcount(b) == 0 for b in range(manager.num_blocks))


@pytest.fixture(scope="session")
def byte_tokenizer() -> Tokenizer:
    return make_byte_tokenizer()


@pytest.fixture
def make_engine(byte_tokenizer: Tokenizer) -> EngineFactory:
    """``make_engine(**EngineConfig overrides)``: a fresh tiny engine per call."""

    def factory(**overrides: Any) -> LLMEngine:
        return make_tiny_engine(byte_tokenizer, **overrides)

    return factory
