"""LLMEngine end to end on a tiny random-weight model: correctness against a cache-free
reference, batch independence, sampling parameters, n > 1, preemption, aborts and limits."""

from __future__ import annotations

import time

import pytest
import torch

from engine.core.llm_engine import LLMEngine
from engine.core.outputs import EngineRequest, ErrorKind, RequestError
from engine.core.outputs import SamplingParams as CoreSamplingParams
from engine.serving.frames import generate_frames
from engine.serving.requests import tokenize
from engine.serving.server import HTTP_STATUS
from protocol.rpc import DeltaFrame, FinalFrame, GenerateRequest, SamplingParams
from tests.engine.tiny_engine import (
    EngineFactory,
    add_wire_request,
    assert_every_block_comes_back,
    blocks_held_by_requests,
)

PROMPTS = [
    "a",
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "0123456789" * 4,
    "naïve café ☕",
    "short",
    "x" * 57,
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit",
    "?",
    "one two three four five six",
    "tab\tand\nnewline",
    "b" * 23,
    "mixed Length prompt number thirteen",
    "zz",
    "Ünïcödé",
    "last prompt in the batch of sixteen, somewhat longer than most of the others",
]


def request(rid: str, prompt: str | list[int], **sampling) -> GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    return GenerateRequest(request_id=rid, prompt=prompt, sampling=SamplingParams(**sampling))


def run(engine: LLMEngine, *requests: GenerateRequest) -> dict[str, list[DeltaFrame | FinalFrame]]:
    return generate_frames(engine, list(requests))


def tokens_of(frames: list[DeltaFrame | FinalFrame], index: int = 0) -> list[int]:
    return [t for f in frames if isinstance(f, DeltaFrame) and f.index == index for t in f.token_ids]


def text_of(frames: list[DeltaFrame | FinalFrame], index: int = 0) -> str:
    return "".join(f.text for f in frames if isinstance(f, DeltaFrame) and f.index == index)


def final_of(frames: list[DeltaFrame | FinalFrame]) -> FinalFrame:
    assert isinstance(frames[-1], FinalFrame)
    assert sum(isinstance(f, FinalFrame) for f in frames) == 1
    return frames[-1]


@torch.inference_mode()
def reference_greedy(engine: LLMEngine, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding by re-running the whole sequence without any KV cache."""
    ids = list(prompt)
    for _ in range(num_tokens):
        hidden = engine.runner.model(torch.tensor(ids), torch.arange(len(ids)))
        ids.append(int(engine.runner.model.compute_logits(hidden[-1:]).argmax()))
    return ids[len(prompt) :]


def test_greedy_matches_cache_free_reference(make_engine: EngineFactory) -> None:
    engine = make_engine(max_num_batched_tokens=8)  # chunked prefill, several chunks per prompt
    prompts = PROMPTS[2:5]
    frames = run(engine, *(request(str(i), p, max_tokens=12, ignore_eos=True) for i, p in enumerate(prompts)))
    for i, p in enumerate(prompts):
        assert tokens_of(frames[str(i)]) == reference_greedy(engine, engine.tokenizer.encode(p), 12)


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prompts"])
def test_batch_of_16_matches_each_request_alone(
    make_engine: EngineFactory, chunked: bool, prefix_cache: bool
) -> None:
    engine = make_engine(
        enable_chunked_prefill=chunked,
        enable_prefix_cache=prefix_cache,
        max_num_batched_tokens=32,
        num_kv_blocks=256,
    )
    alone = {p: tokens_of(run(engine, request("a", p, max_tokens=16, ignore_eos=True))["a"]) for p in PROMPTS}
    batch = run(engine, *(request(str(i), p, max_tokens=16, ignore_eos=True) for i, p in enumerate(PROMPTS)))
    assert {p: tokens_of(batch[str(i)]) for i, p in enumerate(PROMPTS)} == alone
    assert_every_block_comes_back(engine)


def test_preemption_by_recompute_keeps_outputs(make_engine: EngineFactory) -> None:
    roomy = make_engine(num_kv_blocks=256)
    tight = make_engine(num_kv_blocks=24)  # 96 tokens of KV for 6 x (~30 prompt + 24 output)
    reqs = [request(str(i), PROMPTS[i + 2][:30], max_tokens=24, ignore_eos=True) for i in range(6)]
    expected = run(roomy, *reqs)
    got = run(tight, *reqs)
    assert tight.metrics.preemptions._value.get() > 0
    assert {k: tokens_of(v) for k, v in got.items()} == {k: tokens_of(v) for k, v in expected.items()}
    assert_every_block_comes_back(tight)


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_thousand_aborted_requests_free_every_block(make_engine: EngineFactory, prefix_cache: bool) -> None:
    """Without the prefix cache every block is back on the free list; with it, blocks aborted requests
    computed stay in the tree, unreferenced by any request, and all come back when it lets go."""
    engine = make_engine(num_kv_blocks=256, max_num_seqs=16, enable_prefix_cache=prefix_cache)
    start = engine.block_manager.num_free_blocks
    for round_ in range(20):
        ids = [f"{round_}-{i}" for i in range(50)]
        for i, rid in enumerate(ids):
            add_wire_request(engine, request(rid, PROMPTS[i % 16][:12], max_tokens=50, ignore_eos=True))
        engine.step()  # 16 running (prefilled), 34 waiting
        for rid in ids[::2]:
            out = engine.abort_request(rid)
            assert out is not None and out.usage is not None and out.usage.finish_reason == "abort"
        engine.step()  # the rest: some decoding, some just admitted
        assert blocks_held_by_requests(engine) > 0
        for rid in ids[1::2]:
            out = engine.abort_request(rid)
            assert out is not None and out.usage is not None and out.usage.finish_reason == "abort"
        assert blocks_held_by_requests(engine) == 0
    if not prefix_cache:
        assert engine.block_manager.num_free_blocks == start
    assert_every_block_comes_back(engine)
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    assert engine.abort_request("unknown") is None


def test_over_long_and_invalid_prompts_are_refused(make_engine: EngineFactory) -> None:
    engine = make_engine(max_model_len=64)
    with pytest.raises(RequestError, match="maximum context length is 64 tokens"):
        add_wire_request(engine, request("long", "y" * 64))
    with pytest.raises(RequestError, match="empty"):
        add_wire_request(engine, request("empty", ""))
    with pytest.raises(RequestError, match="token ids"):
        add_wire_request(engine, request("ids", [1, 2, 100000]))
    with pytest.raises(RequestError) as wrong_model:
        add_wire_request(engine, GenerateRequest(request_id="m", model="other", prompt="hi"))
    assert wrong_model.value.kind is ErrorKind.MODEL_NOT_FOUND and HTTP_STATUS[wrong_model.value.kind] == 404
    assert not engine.has_unfinished_requests()
    # max_tokens beyond the context is cut to the room left.
    final = final_of(run(engine, request("fit", "y" * 60, max_tokens=100, ignore_eos=True))["fit"])
    assert (final.finish_reason, final.completion_tokens) == ("length", 4)


def test_max_tokens_and_usage(make_engine: EngineFactory) -> None:
    engine = make_engine()
    frames = run(engine, request("r", "hello", max_tokens=7, ignore_eos=True))["r"]
    final = final_of(frames)
    assert (final.prompt_tokens, final.completion_tokens, final.finish_reason) == (5, 7, "length")
    assert len(tokens_of(frames)) == 7
    assert frames[-2].finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_batch_independent(make_engine: EngineFactory) -> None:
    engine = make_engine()
    params = dict(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    first = tokens_of(run(engine, request("s", "seeded", **params))["s"])
    crowd = [request(f"o{i}", p, temperature=1.0, max_tokens=20) for i, p in enumerate(PROMPTS[:7])]
    again = tokens_of(run(engine, *crowd, request("s", "seeded", **params))["s"])
    other_seed = tokens_of(run(engine, request("s", "seeded", **(params | {"seed": 99})))["s"])
    assert first == again
    assert first != other_seed


def test_stop_string_across_token_boundaries_is_cut_and_never_streamed(make_engine: EngineFactory) -> None:
    engine = make_engine()
    plain = run(engine, request("p", "hello", max_tokens=24, ignore_eos=True))["p"]
    text, plain_tokens = text_of(plain), tokens_of(plain)
    # Three characters after the start (byte tokens: each is its own token or more).
    start = next(i for i in range(3, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    stop = text[start : start + 3]
    cut = text[: text.index(stop)]
    frames = run(engine, request("s", "hello", max_tokens=24, ignore_eos=True, stop=["@@never", stop]))["s"]
    assert text_of(frames) == cut
    assert final_of(frames).finish_reason == "stop"
    # Billed up to the token that completed the stop string.
    decode = engine.tokenizer.decode
    billed = next(k for k in range(len(plain_tokens) + 1) if stop in decode(plain_tokens[:k]))
    assert tokens_of(frames) == plain_tokens[:billed]
    streamed = ""
    for f in frames[:-1]:
        streamed += f.text
        assert cut.startswith(streamed)  # no partial stop string ever went out


def test_stop_token_ids_and_eos(make_engine: EngineFactory) -> None:
    engine = make_engine()
    greedy = tokens_of(run(engine, request("g", "hello", max_tokens=8, ignore_eos=True))["g"])
    frames = run(engine, request("t", "hello", max_tokens=8, stop_token_ids=[greedy[3]]))["t"]
    stop_at = greedy.index(greedy[3])
    assert tokens_of(frames) == greedy[: stop_at + 1]
    assert final_of(frames).finish_reason == "stop"
    assert engine.tokenizer.encode(text_of(frames)) == greedy[:stop_at]  # the stop token is not in the text


def test_penalties_discourage_repeats(make_engine: EngineFactory) -> None:
    engine = make_engine()
    plain = tokens_of(run(engine, request("a", "hello", max_tokens=24, ignore_eos=True))["a"])
    penalised = tokens_of(
        run(engine, request("b", "hello", max_tokens=24, ignore_eos=True, frequency_penalty=2.0))["b"]
    )
    assert len(set(plain)) < len(set(penalised))
    presence = tokens_of(
        run(engine, request("c", "hello", max_tokens=24, ignore_eos=True, presence_penalty=2.0))["c"]
    )
    assert presence != plain


def test_n_choices_share_the_prompt_and_match_single_runs(make_engine: EngineFactory) -> None:
    engine = make_engine()
    prompt = PROMPTS[7]  # longer than a block, so children share full prompt blocks
    single = tokens_of(run(engine, request("one", prompt, max_tokens=10, ignore_eos=True))["one"])
    frames = run(engine, request("n", prompt, n=3, max_tokens=10, ignore_eos=True))["n"]
    assert [tokens_of(frames, i) for i in range(3)] == [single] * 3
    final = final_of(frames)
    assert (final.prompt_tokens, final.completion_tokens) == (len(prompt), 30)
    assert final.finish_reasons == ["length"] * 3

    seeded = dict(temperature=1.0, seed=5, n=3, max_tokens=10, ignore_eos=True)
    a = run(engine, request("x", prompt, **seeded))["x"]
    b = run(engine, request("x", prompt, **seeded))["x"]
    choices = [tokens_of(a, i) for i in range(3)]
    assert choices == [tokens_of(b, i) for i in range(3)]
    assert len({tuple(c) for c in choices}) == 3
    assert_every_block_comes_back(engine)


def test_logprobs_in_frames(make_engine: EngineFactory) -> None:
    engine = make_engine()
    params = dict(max_tokens=3, logprobs=True, top_logprobs=2, ignore_eos=True)
    frames = run(engine, request("l", "hi", **params))["l"]
    deltas = [f for f in frames if isinstance(f, DeltaFrame)]
    assert all(f.logprobs and len(f.logprobs[0].top_logprobs) == 2 for f in deltas)
    for f in deltas:  # greedy: the chosen token is the most likely one
        assert f.logprobs[0].logprob == pytest.approx(f.logprobs[0].top_logprobs[0].logprob)


def test_chat_messages_use_the_template(make_engine: EngineFactory) -> None:
    engine = make_engine()
    chat = GenerateRequest(
        request_id="c", messages=[{"role": "user", "content": "hi"}], sampling=SamplingParams(max_tokens=2)
    )
    expected = engine.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenize(chat, engine.tokenizer) == expected
    assert final_of(run(engine, chat)["c"]).prompt_tokens == len(expected)


def test_expired_deadline_aborts(make_engine: EngineFactory) -> None:
    engine = make_engine()
    late = GenerateRequest(request_id="d", prompt="hello", deadline=time.time() - 1)
    frames = run(engine, late)["d"]
    assert final_of(frames).finish_reason == "abort"
    assert_every_block_comes_back(engine)


def test_core_outputs_are_what_the_frames_carry(make_engine: EngineFactory) -> None:
    """The core speaks its own types: token ids, text and usage come out as plain data."""
    engine = make_engine()
    sampling = CoreSamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=True)
    prompt = engine.tokenizer.encode("hello")
    out = engine.generate([EngineRequest("core", prompt, sampling)])["core"]
    frames = run(engine, request("wire", "hello", max_tokens=5, ignore_eos=True, logprobs=True))["wire"]
    assert [t for d in out.deltas for t in d.token_ids] == tokens_of(frames)
    assert "".join(d.text for d in out.deltas) == text_of(frames)
    assert all(d.logprobs and d.logprobs[0].token_id == d.token_ids[0] for d in out.deltas)
    assert out.usage is not None and out.usage.finish_reasons == final_of(frames).finish_reasons
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), 5)
