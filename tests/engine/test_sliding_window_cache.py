"""Gemma 3's sliding-window layers in the paged cache: a pool of their own whose blocks out of the
window are freed while a sequence runs, and the prefix cache reusing a prefix only where those layers'
KV is still exact (engine/cache/block_manager.py, prefix_cache.py).

A tiny Gemma 3 GGUF (tests/engine/families_gguf.py: window 6, layers 0-4 local, 5 global) in
float32 through ``LLMEngine`` with 4-token blocks, against the same engine without a prefix cache and
against transformers' greedy loop."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import EngineRequest
from engine.loader import LoadedModel, load_model
from protocol.rpc import SamplingParams
from tests.engine.families_gguf import tiny_family_model, write_family_gguf
from tests.engine.test_parity_hf import hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, Any]:
    hf_model = tiny_family_model("gemma3")
    path = write_family_gguf(hf_model, "gemma3", tmp_path_factory.mktemp("gemma") / "tiny-gemma3.gguf")
    return load_model(path, progress=False), hf_model


def _engine(loaded: LoadedModel, prefix_cache: bool) -> LLMEngine:
    config = EngineConfig(
        device="cpu",
        block_size=BLOCK,
        num_kv_blocks=128,
        max_num_batched_tokens=64,
        num_threads=1,
        enable_prefix_cache=prefix_cache,
    )
    return LLMEngine(
        config, model=loaded.model, tokenizer=loaded.tokenizer, model_config=loaded.config, model_name="g"
    )


def _request(request_id: str, prompt: list[int], tokens: int) -> EngineRequest:
    sampling = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)


def _greedy(engine: LLMEngine, request_id: str, prompt: list[int], tokens: int) -> tuple[list[int], int]:
    """(generated tokens, prompt tokens taken from the prefix cache)."""
    out = engine.generate([_request(request_id, prompt, tokens)])[request_id]
    assert out.usage is not None
    return [t for delta in out.deltas for t in delta.token_ids], out.usage.cached_tokens


def _prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 259, (length,), generator=generator).tolist()


def test_a_long_sequence_holds_local_blocks_for_its_window_only(gemma: tuple[LoadedModel, Any]) -> None:
    loaded, hf_model = gemma
    window = loaded.config.sliding_window
    assert window is not None
    engine = _engine(loaded, prefix_cache=False)
    manager = engine.block_manager
    assert manager.local is not None and engine.runner.local_kv_cache is not None
    prompt = _prompt(1, 2 * window)
    engine.add_request(_request("long", prompt, 8 * window - len(prompt)))
    generated: list[int] = []
    most_local = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            generated.extend(t for delta in out.deltas for t in delta.token_ids)
        for seq in engine.scheduler.running:
            # the window's positions span at most this many pages, plus the page being written
            assert manager.num_local_blocks(seq) <= -(-(window - 1) // BLOCK) + 2
            assert len(seq.block_table) >= -(-seq.num_computed_tokens // BLOCK)  # global layers keep all
            in_use = manager.local.num_blocks - manager.local.num_free
            assert in_use == manager.num_local_blocks(seq)  # the rest went back to the pool
            most_local = max(most_local, in_use)
    window_pages = -(-(window - 1) // BLOCK) + 2
    assert 0 < most_local <= window_pages < 8 * window // BLOCK  # the whole sequence's pages: 8 windows
    assert manager.local.num_free == manager.local.num_blocks  # all back once it finished
    assert generated == hf_greedy(hf_model, prompt, 8 * window - len(prompt))


def test_with_the_prefix_cache_the_local_pool_still_grows_by_the_window_only(
    gemma: tuple[LoadedModel, Any],
) -> None:
    """The prefix cache keeps a local block beside each page as it is inserted (while the page is in
    the window): those the tree alone holds are reused before a never-written block is taken, so
    the local pool's written part is what the window needs, as without the cache (it was every page:
    16 streams of 4,096 tokens on Gemma-3-1B wrote 1.4 GB of local pool where llama-server's is 352 MB)."""
    loaded, hf_model = gemma
    window = loaded.config.sliding_window
    assert window is not None
    engine = _engine(loaded, prefix_cache=True)
    manager = engine.block_manager
    assert manager.local is not None
    prompt = _prompt(5, 2 * window)
    generated, _ = _greedy(engine, "long", prompt, 8 * window - len(prompt))
    window_pages = -(-(window - 1) // BLOCK) + 2
    assert manager.allocator.num_written == 8 * window // BLOCK  # the global layers keep every page
    assert 0 < manager.local.num_written <= window_pages  # it was 8 * window // BLOCK: every page
    assert generated == hf_greedy(hf_model, prompt, 8 * window - len(prompt))


def test_a_prefix_cache_hit_across_the_window_gives_the_tokens_of_no_cache(
    gemma: tuple[LoadedModel, Any],
) -> None:
    loaded, _ = gemma
    window = loaded.config.sliding_window
    assert window is not None
    shared = _prompt(2, 5 * window)  # far past the window
    first, second = shared + _prompt(3, 5), shared + _prompt(4, 7)
    tokens = 3 * window
    # One engine at a time: an engine gives the model's layers its own pools when it is made.
    plain = _engine(loaded, prefix_cache=False)
    expected = [_greedy(plain, name, prompt, tokens)[0] for name, prompt in (("a", first), ("b", second))]
    cached = _engine(loaded, prefix_cache=True)
    assert _greedy(cached, "a", first, tokens) == (expected[0], 0)
    got, hit = _greedy(cached, "b", second, tokens)
    assert hit > window  # reused across the window boundary
    assert got == expected[1]
    # the same prompt again: a hit up to its last page, the same tokens
    again, hit_again = _greedy(cached, "c", second, tokens)
    assert hit_again > hit and again == got
