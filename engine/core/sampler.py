"""Turns the step's logits into one token per sequence, batched over rows.

Every transform is row-wise, and random draws come from each sequence's own
``torch.Generator``, so a sequence's tokens do not depend on what else is in
the batch: a seeded request is reproducible. Sampling uses the exponential-race
trick (``argmax(p / E)`` with ``E ~ Exp(1)``), which draws from ``p`` exactly.

Order, as in vLLM and transformers: grammar masks (structured output), penalties,
then temperature, then top-k, top-p and min-p. Reported logprobs are those of the model's raw distribution
(before penalties and temperature), like the OpenAI API.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.outputs import SamplingParams
from engine.core.sequence import Sequence
from engine.structured.grammar import mask_logits


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
    """``logits`` [N, V] float32, one row per sequence in ``seqs``."""
    params = [s.sampling for s in seqs]
    if all(_is_plain_greedy(p) for p in params):  # the common case: one argmax over the batch
        return [SampledToken(t) for t in _argmax(apply_grammars(logits, seqs)).tolist()]
    raw_logprobs = None
    if any(p.logprobs or p.top_logprobs for p in params):
        raw_logprobs = torch.log_softmax(logits, dim=-1)

    logits = apply_penalties(apply_grammars(logits, seqs), seqs)
    token_ids = _argmax(logits)
    random_rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = filtered_probs(logits[rows], [params[i] for i in random_rows])
        noise = torch.stack(
            [torch.empty_like(probs[0]).exponential_(generator=seqs[i].generator) for i in random_rows]
        )
        token_ids[rows] = _argmax(probs / noise)

    chosen = token_ids.tolist()
    results = [SampledToken(t) for t in chosen]
    if raw_logprobs is not None:
        attach_logprobs(results, raw_logprobs, params)
    return results


def apply_grammars(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Forbid what each constrained sequence's grammar does not allow next; other rows are untouched."""
    rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if not rows:
        return logits
    constrained = [s for s in seqs if s.matcher is not None]
    budgets = [s.max_tokens - s.num_output_tokens for s in constrained]
    return mask_logits(logits, rows, [m for s in constrained if (m := s.matcher) is not None], budgets)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition (over prompt and output, transformers-style), presence and frequency (output only)."""
    rows = [i for i, s in enumerate(seqs) if has_penalty(s.sampling)]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in rows:
        p, seq = seqs[i].sampling, seqs[i]
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
            seen = seen[seen < vocab]
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
            output = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(output[output < vocab], minlength=vocab).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first index among ties, like ``argmax``); ``max`` is about twice as fast on CPU."""
    return x.max(dim=-1).indices


def _is_plain_greedy(p: SamplingParams) -> bool:
    return p.temperature == 0 and not (p.logprobs or p.top_logprobs) and not has_penalty(p)


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p, row by row, as probabilities."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    logits = logits / temperature[:, None]

    top_k = [p.top_k if 0 < p.top_k < logits.shape[1] else 0 for p in params]
    if any(top_k):
        k_max = max(top_k)
        kth = torch.topk(logits, k_max, dim=-1).values
        k_index = torch.tensor([k - 1 if k else k_max - 1 for k in top_k], device=device)
        threshold = kth.gather(1, k_index[:, None])
        limited = torch.tensor([k > 0 for k in top_k], device=device)[:, None]
        logits = logits.masked_fill(limited & (logits < threshold), float("-inf"))

    probs = torch.softmax(logits, dim=-1)

    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=probs.dtype)
    if bool((top_p < 1.0).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before > top_p[:, None]  # the top token always stays
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)

    min_p = torch.tensor([p.min_p for p in params], device=device, dtype=probs.dtype)
    if bool((min_p > 0).any()):
        floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def attach_logprobs(
    results: list[SampledToken], logprobs: torch.Tensor, params: list[SamplingParams]
) -> None:
    chosen = torch.tensor([r.token_id for r in results], device=logprobs.device)
    chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    k_max = max(p.top_logprobs for p in params)
    top_values = top_ids = None
    if k_max:
        top = torch.topk(logprobs, k_max, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    for i, (r, p) in enumerate(zip(results, params, strict=True)):
        if not (p.logprobs or p.top_logprobs):
            continue
        r.logprob = chosen_lp[i]
        if p.top_logprobs and top_ids is not None and top_values is not None:
            r.top_logprobs = list(
                zip(top_ids[i][: p.top_logprobs], top_values[i][: p.top_logprobs], strict=True)
            )
        else:
            r.top_logprobs = []
