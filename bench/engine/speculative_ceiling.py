"""How far n-gram speculation can go on this machine: the step's cost by draft rows, and a replay.

Speculation pays when verifying ``k`` drafts costs less than the steps they save, so what it can
gain is bounded by two measured things: what a decode step costs with ``k`` draft rows, and how
much of a request's time is prefill (the same work with speculation on or off). This benchmark

1. times the decode step of one sequence with 0 to 8 draft rows (drafts that are mostly rejected:
   a step's cost does not depend on how many are kept);
2. runs ``tern bench speculative``'s workloads greedily with speculation off, one request at a
   time, for their outputs and the time of their prefill (the first step) and decode steps;
3. replays those outputs through the engine's own proposer (``NgramSpeculator``, adaptivity
   included), and through an oracle whose ``k`` drafts are always right, pricing every step on a
   line fitted through (1), relative to a one-row step, and scaling (2)'s decode time by that.

4. replays them once more through the same n-gram lookup drafting all it finds (up to 32 tokens,
   never backing off) with draft rows priced at nothing: the bound of any faster verification kernel
   for this lookup, this model and this prefill, per prompt too.

The replay is a model, not a timing (``tern bench speculative`` times the real thing); the oracle
is the ceiling no proposer can pass with this step cost and prefill share. Prints one JSON object.

    python -m bench.engine.speculative_ceiling [--threads N] [--max-tokens 192]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np

from bench.engine import cpu_model
from bench.engine.speculative import settings, warmed_engine
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import EngineRequest, SamplingParams
from engine.core.sequence import Sequence
from engine.core.speculative import NgramSpeculator

MAX_DRAFTS_TIMED = 8
ORACLE_DRAFTS = (4, 8, 16)
FREE_DRAFTS = 32


class Unthrottled(NgramSpeculator):
    """The engine's n-gram lookup drafting all it finds, up to ``num_tokens``, never backing off: what
    it would do if draft rows cost nothing (then more drafts never cost a step)."""

    def record(self, seq: Sequence, *, proposed: int, accepted: int) -> None:
        pass


class FixedDrafts(Unthrottled):
    """As many drafts as there is room for, up to ``num_tokens`` (copies of the last token), never
    adapting: for timing steps by their draft rows."""

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        return tokens[-1:] * k


def timed_steps(
    engine: LLMEngine, prompt: list[int], params: SamplingParams, speculator: NgramSpeculator | None
) -> tuple[list[float], list[int]]:
    """One request alone, with ``speculator`` (None: off): each step's seconds and the output tokens."""
    saved, engine.speculator = engine.speculator, speculator
    engine.add_request(EngineRequest(f"timed-{time.monotonic_ns()}", prompt, params))
    seconds: list[float] = []
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        outputs = engine.step()
        seconds.append(time.perf_counter() - started)
        tokens += [t for out in outputs for delta in out.deltas for t in delta.token_ids]
    engine.speculator = saved
    return seconds, tokens


def step_seconds(engine: LLMEngine, prompt: list[int], *, steps: int = 48, repeats: int = 3) -> list[float]:
    """Seconds of one decode step with 0..MAX_DRAFTS_TIMED draft rows (best of ``repeats``)."""
    best = [float("inf")] * (MAX_DRAFTS_TIMED + 1)
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    for _ in range(repeats):
        for k in range(MAX_DRAFTS_TIMED + 1):
            fixed = FixedDrafts(num_tokens=k, ngram_min=1, ngram_max=1, max_batch=1) if k else None
            seconds, _ = timed_steps(engine, prompt, params, fixed)
            decode = seconds[2:]  # the prompt's prefill and the first decode step left out
            best[k] = min(best[k], sum(decode) / len(decode))
    return best


def replay(
    prompt: list[int], output: list[int], *, speculator: NgramSpeculator | None = None, oracle: int = 0
) -> list[int]:
    """Drafts per decode step to produce ``output`` after ``prompt``: the speculator's proposals,
    kept while they match ``output``, or (without one) the next ``oracle`` tokens, always right."""
    seq = Sequence("replay", list(prompt), SamplingParams(temperature=0), max_tokens=len(output))
    drafts_per_step: list[int] = []
    while (done := seq.num_output_tokens) < len(output):
        seq.num_computed_tokens = seq.num_tokens - 1  # decoding: only the last token is uncomputed
        if speculator is not None:
            speculator.propose([seq], max_model_len=len(prompt) + len(output) + 1)
            drafts = seq.draft_token_ids
        else:
            drafts = output[done : done + min(oracle, len(output) - done - 1)]
        kept = 0
        while kept < len(drafts) and drafts[kept] == output[done + kept]:
            kept += 1
        if speculator is not None and drafts:
            speculator.record(seq, proposed=len(drafts), accepted=kept)
        for token in output[done : done + kept + 1]:
            seq.append_token(token)
        drafts_per_step.append(len(drafts))
    return drafts_per_step


Line = tuple[float, float]  # seconds of a one-row step, and of each draft row
Run = tuple[list[int], list[float], list[int]]  # a prompt, its steps' seconds, its output


def step_cost_line(seconds: Seq[float]) -> Line:
    """Least-squares line through the timed step costs: (one-row step, cost of each draft row).
    Single timings move by a few ms from run to run; the line prices every draft count alike."""
    slope, intercept = np.polyfit(np.arange(len(seconds)), np.asarray(seconds), 1)
    return float(intercept), float(slope)


def priced(drafts_per_step: Seq[int], line: Line) -> float:
    """Decode time of these steps at ``line``'s cost."""
    base, per_row = line
    return sum(base + per_row * k for k in drafts_per_step)


def workload(
    engine: LLMEngine,
    speculator: NgramSpeculator,
    prompts: list[list[int]],
    seconds: list[float],
    max_tokens: int,
) -> dict[str, Any]:
    """Greedy outputs with speculation off, timed, then the proposer's and the oracles' replays of
    their decode steps (every token after the first), priced at the measured step cost; and the
    lookup's replay with draft rows free (what no faster verification can pass), per prompt too."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    runs = [(p, *timed_steps(engine, p, params, None)) for p in prompts]
    line = step_cost_line(seconds)
    free_rows = (line[0], 0.0)

    def replays(**how: Any) -> list[list[int]]:
        """Drafts per decode step of every run (its first token comes with the prefill)."""
        return [replay(p + out[:1], out[1:], **how) for p, _, out in runs]

    def summary(runs: list[Run], steps: list[list[int]], line: Line) -> dict[str, Any]:
        prefill, decode = phase_seconds(runs)
        priced_off = sum(priced([0] * (len(out) - 1), line) for *_, out in runs)
        decode_on = decode * sum(priced(s, line) for s in steps) / priced_off
        return {
            "steps": sum(map(len, steps)),
            "drafts": sum(map(sum, steps)),
            "drafts_kept": sum(len(out) - 1 for *_, out in runs) - sum(map(len, steps)),
            "decode_speedup": round(decode / decode_on, 3),
            "end_to_end_speedup": round((prefill + decode) / (prefill + decode_on), 3),
        }

    proposer = replays(speculator=speculator)
    lookup = Unthrottled(
        num_tokens=FREE_DRAFTS, ngram_min=speculator.ngram_min, ngram_max=speculator.ngram_max, max_batch=1
    )
    lookup_free = replays(speculator=lookup)
    prefill, decode = phase_seconds(runs)
    return {
        "prompts": len(prompts),
        "output_tokens": sum(len(out) for *_, out in runs),
        "prefill_s": round(prefill, 3),
        "decode_s": round(decode, 3),
        "proposer": summary(runs, proposer, line),
        "lookup_draft_rows_free": summary(runs, lookup_free, free_rows),
        "oracle": {k: summary(runs, replays(oracle=k), line) for k in ORACLE_DRAFTS},
        "per_prompt": [
            {
                "prompt_tokens": len(run[0]),
                "output_tokens": len(run[2]),
                "proposer": summary([run], [steps], line)["end_to_end_speedup"],
                "lookup_draft_rows_free": summary([run], [free], free_rows)["end_to_end_speedup"],
            }
            for run, steps, free in zip(runs, proposer, lookup_free, strict=True)
        ],
    }


def phase_seconds(runs: list[Run]) -> tuple[float, float]:
    """Seconds of prefill (each run's first step, which also samples its first token) and of decode."""
    return sum(timing[0] for _, timing, _ in runs), sum(sum(timing[1:]) for _, timing, _ in runs)


def main(argv: Seq[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    engine, speculator, grounded, open_ended = warmed_engine(args.threads)
    seconds = step_seconds(engine, grounded[0])
    result = {
        "model": engine.model_name,
        "cpu": cpu_model(),
        "settings": settings(speculator),
        "step_ms_by_drafts": [round(1000 * s, 2) for s in seconds],
        "step_ms_line": [round(1000 * x, 3) for x in step_cost_line(seconds)],  # one row, each draft row
        "input_grounded_1_stream": workload(engine, speculator, grounded, seconds, args.max_tokens),
        "open_ended_1_stream": workload(engine, speculator, open_ended[:6], seconds, args.max_tokens),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
