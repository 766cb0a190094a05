"""The prefix cache inside the engine: greedy outputs are the same with it on and off, and
``cached_tokens`` says how much prefill it saved."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

from engine.cache.prefix_cache import PrefixCachingBlockManager
from engine.core.llm_engine import LLMEngine
from engine.serving.frames import generate_frames
from engine.serving.server import create_app
from protocol.rpc import DeltaFrame, FinalFrame, GenerateRequest, SamplingParams, parse_frame
from tests.engine.tiny_engine import add_wire_request, make_byte_tokenizer, make_tiny_engine
from tests.gateway.live_server import ServerThread

SYSTEM = "You are a terse assistant. Answer in one line, please. "  # 55 bytes: ends mid-block (block 4)
QUESTIONS = ["What is 2+2?", "Name a colour.", "Why is the sky blue?", "Say hi.", "Count to three."]

Frames = list[DeltaFrame | FinalFrame]


def engine(prefix_cache: bool, **overrides: Any) -> LLMEngine:
    settings: dict[str, Any] = {"num_kv_blocks": 256, "enable_prefix_cache": prefix_cache}
    return make_tiny_engine(make_byte_tokenizer(), **(settings | overrides))


def request(rid: str, prompt: str, *, namespace: str | None = None, max_tokens: int = 8) -> GenerateRequest:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return GenerateRequest(request_id=rid, prompt=prompt, sampling=sampling, cache_namespace=namespace)


def tokens(frames: Frames, index: int = 0) -> list[int]:
    return [t for f in frames if isinstance(f, DeltaFrame) and f.index == index for t in f.token_ids]


def final(frames: Frames) -> FinalFrame:
    assert isinstance(frames[-1], FinalFrame)
    return frames[-1]


def one_by_one(llm: LLMEngine, requests: list[GenerateRequest]) -> dict[str, Frames]:
    return {r.request_id: generate_frames(llm, [r])[r.request_id] for r in requests}


def assert_same_tokens(got: dict[str, Frames], expected: dict[str, Frames]) -> None:
    assert {k: tokens(v) for k, v in got.items()} == {k: tokens(v) for k, v in expected.items()}


def assert_all_blocks_come_back(llm: LLMEngine) -> None:
    manager = llm.block_manager
    assert isinstance(manager, PrefixCachingBlockManager)
    assert manager.num_free_blocks + manager.num_reclaimable_blocks() == manager.num_blocks
    manager.cache.evict(manager.num_blocks)
    assert manager.num_free_blocks == manager.num_blocks


def test_shared_prefix_is_reused_and_outputs_are_unchanged() -> None:
    reqs = [request(str(i), SYSTEM + q) for i, q in enumerate(QUESTIONS)]
    cold = one_by_one(engine(False), reqs)
    llm = engine(True)
    warm = one_by_one(llm, reqs)
    assert_same_tokens(warm, cold)
    assert final(warm["0"]).cached_tokens == 0
    for i in range(1, len(QUESTIONS)):
        # Everything shared with an earlier request is reused, including the part of a block
        # (SYSTEM is 55 bytes; with 4-token blocks the match ends mid-block and is copied).
        shared = max(len(_common(SYSTEM + QUESTIONS[i], SYSTEM + q)) for q in QUESTIONS[:i])
        assert final(warm[str(i)]).cached_tokens == shared
        assert final(cold[str(i)]).cached_tokens == 0
    assert_all_blocks_come_back(llm)


def test_repeated_prompt_reuses_all_but_its_last_token() -> None:
    prompt = SYSTEM + QUESTIONS[0]  # 67 bytes
    llm = engine(True)
    first, second = (generate_frames(llm, [request(rid, prompt)])[rid] for rid in ("a", "b"))
    assert tokens(first) == tokens(second)
    assert final(second).cached_tokens == len(prompt) - 1
    # The first request's generated tokens were cached too (whole blocks of those computed:
    # all but the last sampled token), so a follow-up turn reuses them.
    follow_up = prompt + llm.tokenizer.decode(tokens(first)) + " And 3+3?"
    third = generate_frames(llm, [request("c", follow_up)])["c"]
    computed = len(prompt) + len(tokens(first)) - 1
    assert final(third).cached_tokens == computed // 4 * 4
    assert tokens(third) == tokens(generate_frames(engine(False), [request("c", follow_up)])["c"])


@pytest.mark.parametrize("cut", [1, 2, 3, 4, 5, 6, 7])
def test_matches_ending_at_every_offset_in_a_block(cut: int) -> None:
    base = "0123456789abcdefghij"
    prompts = {"base": base, "other": base[: 8 + cut] + "XYZ" + base[8:]}
    reqs = [request(k, p, max_tokens=6) for k, p in prompts.items()]
    llm = engine(True)
    warm = one_by_one(llm, reqs)
    assert_same_tokens(warm, one_by_one(engine(False), reqs))
    assert final(warm["other"]).cached_tokens == 8 + cut


def test_evictions_under_a_tiny_block_pool_keep_outputs() -> None:
    prompts = [f"{i} " + SYSTEM[i:] + q for i in range(4) for q in QUESTIONS[:3]]
    reqs = [request(str(i), p, max_tokens=6) for i, p in enumerate(prompts)]
    roomy = generate_frames(engine(False), reqs)
    llm = engine(True, num_kv_blocks=40, max_num_seqs=4)  # 160 tokens: two requests at a time, barely
    got = generate_frames(llm, reqs)
    assert_same_tokens(got, roomy)
    stats = llm.block_manager.cache.stats()  # type: ignore[attr-defined]
    assert stats.evicted_blocks > 0
    assert sum(final(f).cached_tokens for f in got.values()) > 0
    assert_all_blocks_come_back(llm)


def test_concurrent_requests_share_a_prefix_still_being_prefilled() -> None:
    reqs = [request(str(i), SYSTEM * 2 + q) for i, q in enumerate(QUESTIONS)]
    expected = one_by_one(engine(False), reqs)
    # 48 tokens a step: the 110-byte shared prefix takes three chunked steps to prefill, and
    # the leftover budget of each step could admit another request sharing it.
    llm = engine(True, max_num_batched_tokens=48)
    got = generate_frames(llm, reqs)
    assert_same_tokens(got, expected)
    cached = sorted(final(f).cached_tokens for f in got.values())
    # The first computes the prefix; the rest wait for its chunks instead of recomputing them.
    assert cached[0] == 0 and all(c >= len(SYSTEM * 2) for c in cached[1:])
    assert_all_blocks_come_back(llm)


def test_concurrent_identical_prompts_in_one_batch() -> None:
    reqs = [request(str(i), SYSTEM + QUESTIONS[0]) for i in range(4)]
    expected = one_by_one(engine(False), reqs[:1])["0"]
    llm = engine(True, max_num_batched_tokens=512)
    got = generate_frames(llm, reqs)
    assert all(tokens(f) == tokens(expected) for f in got.values())
    assert_all_blocks_come_back(llm)


def test_preemption_and_n_choices_with_the_cache() -> None:
    reqs = [request(str(i), SYSTEM[:30] + q, max_tokens=20) for i, q in enumerate(QUESTIONS)]
    expected = generate_frames(engine(False), reqs)
    llm = engine(True, num_kv_blocks=30)
    assert_same_tokens(generate_frames(llm, reqs), expected)
    assert llm.metrics.preemptions._value.get() > 0
    assert_all_blocks_come_back(llm)

    n_request = GenerateRequest(
        request_id="n",
        prompt=SYSTEM + QUESTIONS[1],
        sampling=SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, n=3),
    )
    frames = generate_frames(llm, [n_request])["n"]
    assert tokens(frames, 0) == tokens(frames, 1) == tokens(frames, 2) != []
    assert_all_blocks_come_back(llm)


def test_namespaces_do_not_share() -> None:
    llm = engine(True)
    prompt = SYSTEM + QUESTIONS[0]
    generate_frames(llm, [request("a", prompt, namespace="tenant-a")])
    other = generate_frames(llm, [request("b", prompt, namespace="tenant-b")])["b"]
    same = generate_frames(llm, [request("c", prompt, namespace="tenant-a")])["c"]
    assert final(other).cached_tokens == 0
    assert final(same).cached_tokens == len(prompt) - 1


def test_waiting_queue_prefers_cached_prefixes_within_an_age_bound() -> None:
    llm = engine(True, max_num_seqs=1)
    generate_frames(llm, [request("warm", SYSTEM + QUESTIONS[0])])
    add_wire_request(llm, request("cold", "completely unrelated prompt"))
    add_wire_request(llm, request("hot", SYSTEM + QUESTIONS[1]))
    first = llm.scheduler.schedule().seqs
    assert [s.request_id for s in first] == ["hot"]
    llm.abort_request("hot")

    add_wire_request(llm, request("hot2", SYSTEM + QUESTIONS[2]))
    cold = next(s for s in llm.scheduler.waiting if s.request_id == "cold")
    cold.arrival_time = time.monotonic() - llm.scheduler.max_cache_aware_wait_s  # waited too long
    assert [s.request_id for s in llm.scheduler.schedule().seqs] == ["cold"]


def test_metrics_report_hits_prompts_evictions_and_tree_size() -> None:
    llm = engine(True)
    one_by_one(llm, [request(str(i), SYSTEM + q) for i, q in enumerate(QUESTIONS[:2])])
    text = llm.metrics.render().decode()
    hits = llm.metrics.cached_prompt_tokens._value.get()
    assert hits == len(_common(SYSTEM + QUESTIONS[0], SYSTEM + QUESTIONS[1]))
    assert f"tern_engine_prompt_tokens_cached_total {hits:.1f}" in text
    assert "tern_engine_prompt_tokens_total" in text
    assert "tern_engine_prefix_cache_evicted_blocks_total 0.0" in text
    blocks = llm.block_manager.cache.stats().tree_blocks  # type: ignore[attr-defined]
    assert blocks > 0 and f"tern_engine_prefix_cache_blocks {blocks:.1f}" in text


def test_openai_usage_and_rpc_final_frame_report_cached_tokens() -> None:
    server = ServerThread(create_app(engine(True))).start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}]
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
        second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
        assert first.usage and second.usage and second.usage.prompt_tokens_details
        assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
        assert second.choices[0].message.content == first.choices[0].message.content

        other = [messages[0], {"role": "user", "content": "Bye."}]
        body = {"request_id": "rpc", "messages": other, "sampling": {"max_tokens": 2}}
        with httpx.stream("POST", f"{server.url}/rpc/v1/generate", json=body, timeout=60) as response:
            frames = [parse_frame(line) for line in response.iter_lines() if line]
        last = frames[-1]
        assert isinstance(last, FinalFrame) and last.cached_tokens > len(SYSTEM)
        metrics = httpx.get(f"{server.url}/metrics").text
        assert "tern_engine_prompt_tokens_cached_total" in metrics
        assert "tern_engine_prefix_cache_tokens" in metrics
    finally:
        server.stop()


def _common(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]
