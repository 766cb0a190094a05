"""The sampler on hand-made logits: each filter, the penalties, logprobs and per-sequence RNG."""

from __future__ import annotations

from collections import Counter

import torch

from engine.core.outputs import SamplingParams
from engine.core.sampler import apply_penalties, sample
from engine.core.sequence import Sequence


def make_seq(seed: int = 0, prompt: list[int] | None = None, output: list[int] = (), **params) -> Sequence:
    seq = Sequence("r", prompt or [0], SamplingParams(**params), max_tokens=100)
    seq.generator = torch.Generator().manual_seed(seed)
    seq.token_ids.extend(output)
    return seq


def draws(logits: torch.Tensor, seq: Sequence, n: int) -> Counter[int]:
    return Counter(sample(logits[None], [seq])[0].token_id for _ in range(n))


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def test_greedy_takes_the_argmax_per_row() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    out = sample(logits, [make_seq(temperature=0), make_seq(temperature=0)])
    assert [t.token_id for t in out] == [1, 0]


def test_sampling_follows_the_distribution() -> None:
    counts = draws(LOGITS, make_seq(temperature=1.0), 4000)
    for token, p in enumerate(PROBS.tolist()):
        assert abs(counts[token] / 4000 - p) < 0.03


def test_top_k_top_p_and_min_p_cut_the_tail() -> None:
    assert set(draws(LOGITS, make_seq(top_k=2), 300)) == {0, 1}
    assert set(draws(LOGITS, make_seq(top_p=0.7), 300)) == {0, 1}  # 0.5 + 0.3 covers 0.7
    assert set(draws(LOGITS, make_seq(min_p=0.25), 300)) == {0, 1, 2}  # 0.05 < 0.25 * 0.5
    assert set(draws(LOGITS, make_seq(top_p=0.01), 50)) == {0}  # the top token always stays


def test_low_temperature_sharpens() -> None:
    counts = draws(LOGITS, make_seq(temperature=0.1), 300)
    assert counts[0] > 290


def test_seeded_draws_repeat_and_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    alone = [sample(logits[2:3], [make_seq(seed=7)])[0].token_id]
    seq = make_seq(seed=7)
    others = [make_seq(seed=s) for s in (1, 2, 3, 4, 5)]
    batch_seqs = [*others[:2], seq, *others[2:]]
    in_batch = [t.token_id for t in sample(logits, batch_seqs)][2]
    assert alone == [in_batch]
    run_a = [sample(logits[:1], [s])[0].token_id for s in [make_seq(seed=9)] * 20]
    run_b = [sample(logits[:1], [s])[0].token_id for s in [make_seq(seed=9)] * 20]
    assert run_a == run_b and len(set(run_a)) > 1


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    out = apply_penalties(logits, [make_seq(prompt=[0], output=[1], repetition_penalty=2.0)])
    assert out.tolist() == [[1.0, -4.0, 1.0, 1.0]]


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros(1, 4)
    seq = make_seq(prompt=[3, 3], output=[1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [seq])
    assert out.tolist() == [[0.0, -1.0, -0.75, 0.0]]
    assert logits.abs().sum() == 0  # the input is not modified


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 0.9]])
    assert sample(logits, [make_seq(temperature=0, output=[0])])[0].token_id == 0
    assert sample(logits, [make_seq(temperature=0, output=[0], frequency_penalty=0.5)])[0].token_id == 1


def test_logprobs_are_the_raw_distribution() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    token = sample(logits, [make_seq(temperature=0.5, logprobs=True, top_logprobs=2)])[0]
    raw = torch.log_softmax(logits[0], dim=0)
    assert abs(token.logprob - raw[token.token_id].item()) < 1e-6
    assert [t for t, _ in token.top_logprobs] == [1, 2]
    assert abs(token.top_logprobs[0][1] - raw[1].item()) < 1e-6
    assert sample(logits, [make_seq()])[0].logprob is None
