"""N-gram (prompt-lookup) speculative decoding: guess the next tokens from the sequence itself.

When an answer copies spans of its input (a rewrite, an edit, an answer from a document), the
last few tokens usually occurred before, and what followed them then is a good guess for what
follows now. :class:`NgramSpeculator` proposes up to ``k`` such draft tokens for each decoding
sequence; the step computes the sequence's last token and its drafts in one forward pass (its
query length becomes ``1 + k``), and :func:`verify` keeps the longest prefix of drafts the model's
own sampling agrees with, plus one token of its own. Greedy output is token-identical with and
without speculation; with temperature the standard rejection rule (accept a draft ``d`` with
probability ``p(d)``, else sample from ``p`` without ``d``) keeps the output distribution exact.

It turns itself off where it cannot pay: for a sequence whose drafts keep being rejected (it backs
off, longer each time), and for a whole step whose batch is larger than ``max_batch`` (verifying
drafts for many rows costs more than it saves once the weights are read for the batch anyway).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.core.sampler import SampledToken, attach_logprobs, filtered_probs, has_penalty
from engine.core.sequence import Sequence
from engine.structured.grammar import mask_draft_rows


class NgramSpeculator:
    def __init__(self, *, num_tokens: int, ngram_min: int, ngram_max: int, max_batch: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        self.num_tokens = num_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.max_batch = max_batch

    def propose(self, running: list[Sequence], *, max_model_len: int) -> None:
        """Set ``draft_token_ids`` on the running sequences that are decoding (or clear them)."""
        decoding = [s for s in running if s.num_uncomputed_tokens == 1]
        step_on = 0 < len(running) <= self.max_batch
        for seq in decoding:
            seq.draft_token_ids = []
            if not step_on or not self._eligible(seq):
                continue
            stats = seq.draft_stats
            if stats.cool_down > 0:
                stats.cool_down -= 1
                continue
            room = min(seq.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens) - 1
            k = min(stats.num_tokens or self.num_tokens, room)
            if k > 0:
                seq.draft_token_ids = self._drafts(seq, k)

    def _drafts(self, seq: Sequence, k: int) -> list[int]:
        drafts = self.lookup(seq.token_ids, k)
        if seq.matcher is None:
            return drafts
        # What the grammar refuses would be rejected: not worth a row. Where the lookup has nothing, the
        # tokens the grammar forces next (a schema's keys and punctuation) are drafts nearly always kept.
        return drafts[: seq.matcher.validate_tokens(drafts)] or seq.matcher.compute_ff_tokens()[:k]

    @staticmethod
    def _eligible(seq: Sequence) -> bool:
        """Drafts only where verifying them is exactly the model's own sampling, row by row: not with
        penalties, whose logits depend on every earlier token."""
        return not has_penalty(seq.sampling)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
        n-gram (``ngram_max`` down to ``ngram_min``) that occurred before."""
        if len(tokens) < self.ngram_min + 1:
            return []
        seq = np.asarray(tokens)
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            suffix = seq[-n:]
            candidates = len(seq) - n  # starts of earlier n-grams (the suffix itself excluded)
            match = seq[:candidates] == suffix[0]
            for j in range(1, n):
                match &= seq[j : candidates + j] == suffix[j]
            starts = np.flatnonzero(match)
            if starts.size:
                start = int(starts[-1]) + n
                return tokens[start : start + k]
        return []

    def record(self, seq: Sequence, *, proposed: int, accepted: int) -> None:
        """Adapt to how a sequence's drafts fare: propose more after all were kept, as many as were
        kept (plus one) after some were, and back off from one whose drafts keep failing (4, 8, 16, ...
        steps without drafts)."""
        stats = seq.draft_stats
        if accepted == proposed:
            stats.num_tokens = min(self.num_tokens, proposed + 2)
        else:
            stats.num_tokens = max(2, accepted + 1)
        if accepted:
            stats.misses = 0
        elif proposed:
            stats.misses += 1
            if stats.misses >= 2:
                stats.cool_down = min(2**stats.misses, 64)


def verify(logits: torch.Tensor, seq: Sequence, drafts: list[int]) -> list[SampledToken]:
    """The tokens a sequence keeps from one speculative step: the accepted drafts, then one sampled.

    ``logits`` [k + 1, V]: row ``i`` predicts the token after draft ``i - 1`` (row 0: after the
    sequence's last real token). Greedy: drafts are accepted while they equal the argmax. Sampled:
    draft ``d`` is accepted with probability ``p(d)`` (the filtered distribution the sampler draws
    from); the first rejection samples from ``p`` with ``d`` removed, which is the exact rejection
    rule for a draft that proposes ``d`` with certainty. Random draws come from the sequence's own
    generator, so a seeded request is reproducible.
    """
    params = seq.sampling
    raw_logprobs = torch.log_softmax(logits, dim=-1) if (params.logprobs or params.top_logprobs) else None
    if seq.matcher is not None:  # each row masked as a plain step at its position would be
        logits = mask_draft_rows(logits, seq.matcher, drafts, seq.max_tokens - seq.num_output_tokens)
    chosen: list[int] = []
    if params.temperature == 0:
        targets = logits.max(dim=-1).indices.tolist()
        for draft, target in zip(drafts, targets, strict=False):
            chosen.append(target)
            if draft != target:
                break
        else:
            chosen.append(targets[len(drafts)])
    else:
        probs = filtered_probs(logits, [params] * logits.shape[0])
        generator = seq.generator
        for i, draft in enumerate(drafts):
            if torch.rand((), generator=generator, device=probs.device).item() < probs[i, draft].item():
                chosen.append(draft)
                continue
            residual = probs[i].clone()
            residual[draft] = 0.0
            chosen.append(_draw(residual, generator))
            break
        else:
            chosen.append(_draw(probs[len(drafts)], generator))
    results = [SampledToken(t) for t in chosen]
    if raw_logprobs is not None:
        attach_logprobs(results, raw_logprobs[: len(results)], [params] * len(results))
    return results


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from unnormalised ``probs`` (the exponential race the sampler uses)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax().item())
