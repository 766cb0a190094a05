"""One stream's decode step on a model, in process: wall and CPU milliseconds a token.

    python -m bench.engine.decode_step MODEL [--threads 1] [--tokens 64] [--rounds 2] [--prefill 512 2048]

Loads ``MODEL`` (a GGUF file or a checkpoint directory) as ``tern engine`` does, with its defaults,
and generates ``--tokens`` greedy tokens for one request (EOS ignored) ``--rounds`` times after a
warm-up. The CPU time is the process's (every thread's), so on a machine others share it says what a
token costs where the wall clock does not; compare two commits by running them in turn. With
``--prefill``, also one request of a prompt of each length (random token ids, a new prompt each
round: no prefix cache hit) and one output token: wall and CPU milliseconds a prompt token. Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from pathlib import Path

import torch

from bench.engine import cpu_model
from bench.engine.kernels import git_commit
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import EngineRequest, SamplingParams

PROMPT = [1, 20, 30, 42, 7, 9, 12, 100]


def decode(engine: LLMEngine, tokens: int, request_id: str) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, tokens) for one greedy request of ``tokens`` tokens."""
    sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start, start_cpu = time.perf_counter(), time.process_time()
    out = engine.generate([EngineRequest(request_id, list(PROMPT), sampling)])[request_id]
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    return wall, cpu, sum(len(delta.token_ids) for delta in out.deltas)


def prefill(engine: LLMEngine, length: int, request_id: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) for one request of a ``length``-token prompt and one output token."""
    generator = torch.Generator().manual_seed(zlib.crc32(request_id.encode()))
    prompt = torch.randint(100, 10_000, (length,), generator=generator).tolist()
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start, start_cpu = time.perf_counter(), time.process_time()
    engine.generate([EngineRequest(request_id, prompt, sampling)])
    return time.perf_counter() - start, time.process_time() - start_cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prefill", type=int, nargs="*", default=[], help="prompt lengths to time too")
    args = parser.parse_args(argv)
    engine = LLMEngine.from_config(
        EngineConfig(model=str(args.model), device="cpu", num_threads=args.threads)
    )
    decode(engine, 4, "warm-up")
    rounds = [decode(engine, args.tokens, f"r{i}") for i in range(args.rounds)]
    prompts = [(n, *prefill(engine, n, f"p{n}-{i}")) for i in range(args.rounds) for n in args.prefill]
    report = {
        "benchmark": "decode_step",
        "model": args.model.name,
        "cpu": cpu_model(),
        "threads": args.threads,
        "commit": git_commit(),
        "steps_in_c": engine.steps_in_c,
        "rounds": [
            {
                "tokens": n,
                "wall_ms_per_token": round(wall / n * 1e3, 2),
                "cpu_ms_per_token": round(cpu / n * 1e3, 2),
            }
            for wall, cpu, n in rounds
        ],
        "prefill": [
            {
                "prompt_tokens": n,
                "wall_ms_per_token": round(wall / n * 1e3, 3),
                "cpu_ms_per_token": round(cpu / n * 1e3, 3),
            }
            for n, wall, cpu in prompts
        ],
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
