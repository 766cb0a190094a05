"""One engine's decode steps one by one: CPU and wall time by rows, the slowest steps, speculation on and off.

    python -m bench.engine.step_times [--model GGUF] [--threads 2] [--requests 16] [--max-tokens 128]

The 16 chat prompts (``bench.engine.PROMPTS``) one at a time (1 stream), greedy, EOS ignored, on one
engine; speculation alternates request by request (off, on, on, off, ...) so a neighbour's load hits
both alike. Every forward pass is timed: its rows (tokens in the step: 1 for a plain decode step,
1 + drafts for a verifying one, the prompt's length for a prefill), the process's CPU seconds
(all threads: OpenMP workers spinning at a barrier count too) and wall seconds. Prints one JSON
object per setting: per row count the steps, median CPU and wall ms and the worst wall ms; the one-row
steps' wall p50/p99/max; each request's wall seconds; the drafts proposed and kept; the 8 slowest steps.

What it is for: a stall (a step far slower than its row count explains) shows here without HTTP, a
client or a second server in the way; if one shows in ``engine_vs_llamacpp.sh`` and not here, it is
not the model's steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import time
from typing import Any

import torch

from bench.engine import PROMPTS, cpu_model
from bench.engine.kernels import git_commit
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.model_runner import PreparedStep
from engine.core.outputs import EngineRequest, SamplingParams

Step = tuple[int, float, float]
"""(rows, CPU seconds, wall seconds) of one forward pass."""


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed_forward(engine: LLMEngine, steps: list[Step]) -> None:
    """Wrap the engine's forward pass so each call appends its :data:`Step`."""
    forward = engine.runner.forward

    def timed(step: PreparedStep) -> torch.Tensor:
        cpu, wall = cpu_seconds(), time.perf_counter()
        hidden = forward(step)
        steps.append((len(step.input_ids), cpu_seconds() - cpu, time.perf_counter() - wall))
        return hidden

    engine.runner.forward = timed  # type: ignore[method-assign]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(steps: list[Step], request_walls: list[float], drafted: float, kept: float) -> dict[str, Any]:
    by_rows: dict[int, list[Step]] = {}
    for step in steps:
        by_rows.setdefault(step[0], []).append(step)
    one_row = [wall * 1e3 for rows, _, wall in steps if rows == 1]
    return {
        "steps": len(steps),
        "by_rows": {
            rows: {
                "steps": len(group),
                "cpu_ms_p50": round(statistics.median(s[1] for s in group) * 1e3, 2),
                "wall_ms_p50": round(statistics.median(s[2] for s in group) * 1e3, 2),
                "wall_ms_max": round(max(s[2] for s in group) * 1e3, 1),
            }
            for rows, group in sorted(by_rows.items())
            if rows <= 16  # prefills: one each, their length is the prompt's
        },
        "one_row_wall_ms": {
            "p50": round(percentile(one_row, 0.5), 2),
            "p99": round(percentile(one_row, 0.99), 2),
            "max": round(max(one_row), 1),
        }
        if one_row
        else None,
        "request_wall_s": sorted(round(w, 2) for w in request_walls),
        "drafted": int(drafted),
        "kept": int(kept),
        "slowest_steps_rows_cpu_wall_ms": [
            (rows, round(cpu * 1e3, 1), round(wall * 1e3, 1))
            for rows, cpu, wall in sorted(steps, key=lambda s: -s[2])[:8]
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="a GGUF or checkpoint (default: the default model)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    config = EngineConfig(num_threads=args.threads, speculative="ngram", enable_prefix_cache=False)
    engine = LLMEngine.from_config(dataclasses.replace(config, model=args.model) if args.model else config)
    speculator, metrics = engine.speculator, engine.metrics
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    engine.generate([EngineRequest("warm-up", prompts[0], sampling)])
    steps: list[Step] = []
    timed_forward(engine, steps)
    results: dict[str, dict[str, Any]] = {}
    for setting in ("off", "on"):
        results[setting] = {"steps": [], "walls": [], "drafted": 0.0, "kept": 0.0}
    for i in range(args.requests):
        setting = ("off", "on", "on", "off")[i % 4]
        engine.speculator = speculator if setting == "on" else None
        before = (metrics.draft_tokens._value.get(), metrics.accepted_draft_tokens._value.get())
        start, first = time.perf_counter(), len(steps)
        engine.generate([EngineRequest(f"r{i}", prompts[i % len(prompts)], sampling)])
        result = results[setting]
        result["walls"].append(time.perf_counter() - start)
        result["steps"].extend(steps[first:])
        result["drafted"] += metrics.draft_tokens._value.get() - before[0]
        result["kept"] += metrics.accepted_draft_tokens._value.get() - before[1]
    report = {
        "benchmark": "step_times",
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "commit": git_commit(),
        "model": args.model or config.model,
        "max_tokens": args.max_tokens,
    } | {
        f"speculative_{setting}": summary(r["steps"], r["walls"], r["drafted"], r["kept"])
        for setting, r in results.items()
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
