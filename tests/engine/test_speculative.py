"""N-gram speculative decoding: the same tokens as without it, and nothing left behind.

The tiny random-weight model falls into loops after a few tokens, so its own output feeds the
n-gram lookup and drafts are both accepted and rejected: each test checks drafts really ran.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch

from engine.core.llm_engine import LLMEngine
from engine.core.outputs import SamplingParams
from engine.core.sequence import Sequence
from engine.core.speculative import NgramSpeculator, verify
from engine.serving.frames import generate_frames
from engine.structured.grammar import closed_object, mask_draft_rows, mask_logits
from protocol.rpc import GenerateRequest
from tests.engine.test_engine import PROMPTS, request, run, text_of, tokens_of
from tests.engine.tiny_engine import EngineFactory, assert_every_block_comes_back

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH = PROMPTS[:4]
SPECULATING = {"speculative": "ngram", "speculative_max_batch": len(BATCH)}  # every step of BATCH drafts


def drafts(engine: LLMEngine) -> tuple[float, float]:
    metrics = engine.metrics
    return metrics.draft_tokens._value.get(), metrics.accepted_draft_tokens._value.get()


def outputs(engine: LLMEngine, prompts: list[str], **sampling: Any) -> dict[str, list[int]]:
    frames = run(
        engine,
        *(
            request(str(i), p, **({"max_tokens": 40, "ignore_eos": True} | sampling))
            for i, p in enumerate(prompts)
        ),
    )
    return {rid: tokens_of(f) for rid, f in frames.items()}


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_greedy_is_token_identical_with_speculation_on_and_off(
    make_engine: EngineFactory, prefix_cache: bool
) -> None:
    off = make_engine(speculative="off", enable_prefix_cache=prefix_cache, num_kv_blocks=256)
    on = make_engine(**SPECULATING, enable_prefix_cache=prefix_cache, num_kv_blocks=256)
    expected = outputs(off, BATCH)
    assert outputs(on, BATCH) == expected
    assert outputs(on, BATCH) == expected  # again: prefix-cache hits this time when it is on
    proposed, accepted = drafts(on)
    assert accepted > 0 and proposed > accepted  # drafts were both kept and thrown away
    assert_every_block_comes_back(on)


def test_greedy_is_identical_across_preemption(make_engine: EngineFactory) -> None:
    roomy = make_engine(speculative="off", num_kv_blocks=256)
    tight = make_engine(speculative="ngram", num_kv_blocks=40, speculative_max_batch=6)
    prompts = [p[:30] for p in PROMPTS[2:8]]
    expected = outputs(roomy, prompts, max_tokens=24)
    assert outputs(tight, prompts, max_tokens=24) == expected
    assert tight.metrics.preemptions._value.get() > 0 and drafts(tight)[1] > 0
    assert_every_block_comes_back(tight)


def test_stop_strings_n_and_logprobs_are_unchanged(make_engine: EngineFactory) -> None:
    off = make_engine(speculative="off", num_kv_blocks=256)
    on = make_engine(**SPECULATING, num_kv_blocks=256)
    asked = request("s", BATCH[3], max_tokens=40, stop=[")v"], n=2, logprobs=True, top_logprobs=2)
    a, b = run(off, asked)["s"], run(on, asked)["s"]
    for index in range(2):
        assert text_of(a, index) == text_of(b, index) and tokens_of(a, index) == tokens_of(b, index)
        assert logprobs_of(a, index) == pytest.approx(logprobs_of(b, index), abs=1e-4)
    assert drafts(on)[1] > 0


def logprobs_of(frames: list[Any], index: int) -> list[float]:
    return [
        lp.logprob for f in frames if getattr(f, "index", None) == index and f.logprobs for lp in f.logprobs
    ]


def test_seeded_sampling_is_reproducible(make_engine: EngineFactory) -> None:
    on = make_engine(**SPECULATING, num_kv_blocks=256)
    first = outputs(on, BATCH, temperature=0.8, seed=11)
    assert outputs(on, BATCH, temperature=0.8, seed=11) == first
    assert drafts(on)[0] > 0


def string_list(**bounds: int) -> dict[str, Any]:
    return closed_object(items={"type": "array", "items": {"type": "string", "maxLength": 8}} | bounds)


# Grammars whose limits cut the tiny model's loops short, so drafts meet refusals and masked rows
GRAMMAR_SCHEMAS = [
    string_list(maxItems=5),
    closed_object(a={"type": "string", "maxLength": 30}, b={"type": "string", "maxLength": 30}),
    string_list(),
]


def test_structured_output_is_token_identical_with_speculation_on_and_off(make_engine: EngineFactory) -> None:
    """Drafts the grammar refuses are not proposed, and the rest are judged on rows masked as a plain
    step at their position would be: the same JSON, ending (or cut off) where it did without drafts."""
    off = make_engine(speculative="off", num_kv_blocks=256)
    on = make_engine(**SPECULATING, num_kv_blocks=256)
    asked = [
        GenerateRequest.model_validate(
            {
                "request_id": f"j{i}",
                "messages": [{"role": "user", "content": "Copy: the cat sat on the mat."}],
                "json_schema": schema,
                "sampling": {"temperature": 0.0, "max_tokens": 120},
            }
        )
        for i, schema in enumerate(GRAMMAR_SCHEMAS)
    ]
    expected, got = generate_frames(off, asked), generate_frames(on, asked)
    for asking, schema in zip(asked, GRAMMAR_SCHEMAS, strict=True):
        a, b = expected[asking.request_id], got[asking.request_id]
        assert tokens_of(b) == tokens_of(a) and b[-1].finish_reason == a[-1].finish_reason
        if b[-1].finish_reason == "stop":
            jsonschema.validate(json.loads(text_of(b)), schema)
    assert [f[-1].finish_reason for f in got.values()] == ["stop", "stop", "length"]
    proposed, accepted = drafts(on)
    assert accepted > 0 and proposed > accepted


def test_draft_rows_are_masked_at_their_own_positions_and_the_matcher_ends_as_it_began(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    grammar = engine.grammars.json_schema(GRAMMAR_SCHEMAS[1])
    vocab = engine.model_config.vocab_size
    logits = torch.zeros(7, vocab)

    def plain_step_mask(after: list[int]) -> torch.Tensor:
        fresh = grammar.matcher()
        assert fresh.try_consume_tokens(after) == len(after)
        return mask_logits(torch.zeros(1, vocab), [0], [fresh])[0]

    matcher = grammar.matcher()
    drafts = list(b'{"a": ')
    masked = mask_draft_rows(logits, matcher, drafts)
    for i in range(len(drafts) + 1):
        assert torch.equal(masked[i], plain_step_mask(drafts[:i]))
    assert torch.equal(mask_logits(torch.zeros(1, vocab), [0], [matcher])[0], plain_step_mask([]))

    refused = list(b'{"z": ')  # the schema has no "z": the grammar refuses draft 2
    masked = mask_draft_rows(logits, matcher, refused)
    assert masked[2, ord("z")] == float("-inf") and torch.equal(masked[2], plain_step_mask(refused[:2]))
    assert all(torch.equal(masked[i], masked[2]) for i in range(3, 7))
    assert torch.equal(mask_logits(torch.zeros(1, vocab), [0], [matcher])[0], plain_step_mask([]))


def test_the_speculator_drafts_only_what_the_grammar_allows_or_forces(make_engine: EngineFactory) -> None:
    engine = make_engine()
    speculator = NgramSpeculator(num_tokens=4, ngram_min=2, ngram_max=4, max_batch=4)
    seq = Sequence("g", list(b'ab{"zz}ab'), SamplingParams(temperature=0), max_tokens=50)
    seq.num_computed_tokens = seq.num_tokens - 1
    speculator.propose([seq], max_model_len=100)
    assert seq.draft_token_ids == list(b'{"zz')  # what followed the earlier "ab"
    seq.matcher = engine.grammars.json_schema(GRAMMAR_SCHEMAS[1]).matcher()
    speculator.propose([seq], max_model_len=100)
    assert seq.draft_token_ids == list(b'{"')  # the schema's only key is "a", then "b"
    fresh = Sequence("f", list(b"xyz"), SamplingParams(temperature=0), max_tokens=50)
    fresh.num_computed_tokens, fresh.matcher = 2, seq.matcher
    speculator.propose([fresh], max_model_len=100)
    assert fresh.draft_token_ids == list(b'{"a"')  # nothing to look up: what the grammar forces


def test_rejection_sampling_keeps_the_distribution() -> None:
    """One draft from a point-mass proposal: the first token kept must still be distributed as p."""
    probs = torch.tensor([0.1, 0.5, 0.3, 0.1])
    logits = torch.log(probs).repeat(2, 1)  # row 0 judges the draft; row 1 would follow it
    counts = torch.zeros(4)
    trials = 4000
    for seed in range(trials):
        generator = torch.Generator().manual_seed(seed)
        seq = Sequence("r", [0], SamplingParams(temperature=1.0), max_tokens=8, generator=generator)
        counts[verify(logits, seq, drafts=[2])[0].token_id] += 1
    assert (counts / trials).tolist() == pytest.approx(probs.tolist(), abs=0.03)


def test_a_thousand_aborted_speculative_requests_leak_no_block(make_engine: EngineFactory) -> None:
    engine = make_engine(**SPECULATING, num_kv_blocks=256, max_num_seqs=4)
    for wave in range(250):
        ids = [f"{wave}-{i}" for i in range(4)]
        for rid, prompt in zip(ids, BATCH, strict=True):
            engine.add_request(_core(engine, rid, prompt))
        for _ in range(3 + wave % 5):
            engine.step()
        for rid in ids:
            engine.abort_request(rid)
    assert drafts(engine)[0] > 0 and not engine.has_unfinished_requests()
    assert_every_block_comes_back(engine)


def _core(engine: LLMEngine, rid: str, prompt: str) -> Any:
    from engine.core.outputs import EngineRequest

    ids = engine.tokenizer.encode(prompt)
    return EngineRequest(rid, ids, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))


# -- the proposer and its back-off ---------------------------------------------------------------


def test_lookup_continues_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    speculator = NgramSpeculator(num_tokens=3, ngram_min=1, ngram_max=3, max_batch=4)
    assert speculator.lookup([5, 6, 7, 8, 9, 1, 6, 7], 3) == [8, 9, 1]  # "6 7" occurred at 1
    assert speculator.lookup([1, 2, 3, 9, 2, 3, 4, 1, 2, 3], 2) == [9, 2]  # "1 2 3" beats the later "2 3"
    assert speculator.lookup([2, 3, 7, 2, 3, 8, 2, 3], 1) == [8]  # the latest of two "2 3"
    assert speculator.lookup([1, 2, 3, 4], 2) == []  # nothing repeats


def test_speculation_backs_off_and_large_batches_do_not_speculate() -> None:
    speculator = NgramSpeculator(num_tokens=4, ngram_min=1, ngram_max=2, max_batch=2)

    def decoding(tokens: list[int]) -> Sequence:
        seq = Sequence("r", tokens, SamplingParams(temperature=0), max_tokens=50)
        seq.num_computed_tokens = len(tokens) - 1
        return seq

    seq = decoding([1, 2, 1, 2, 1])
    speculator.propose([seq], max_model_len=100)
    assert seq.draft_token_ids == [2, 1]
    for _ in range(2):
        speculator.record(seq, proposed=2, accepted=0)
    speculator.propose([seq], max_model_len=100)
    assert seq.draft_token_ids == [] and seq.draft_stats.cool_down > 0
    crowd = [decoding([1, 2, 1, 2, 1]) for _ in range(3)]
    speculator.propose(crowd, max_model_len=100)
    assert all(s.draft_token_ids == [] for s in crowd)
