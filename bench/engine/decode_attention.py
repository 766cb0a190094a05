"""One decode row's paged attention on the C kernel: wall microseconds a call by context length.

    python -m bench.engine.decode_attention [--threads 2] [--heads 32 --kv-heads 8 --dim 64]
        [--contexts 64 136 200 512]

A float16 cache laid out as the engine's (blocks of 16 positions), one query row of Llama-3.2-1B's
attention shape by default; for each context length, ``--reps`` batches of 100 calls, the best batch's
wall time a call (a shared machine's preemptions only add time). Compare commits by running each in turn
(or interleaved). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.engine import cpu_model
from bench.engine.kernels import git_commit
from engine.cpu import kernels

BLOCK = 16
CALLS = 100


def best_call_us(context: int, heads: int, kv_heads: int, dim: int, reps: int) -> float:
    blocks = -(-context // BLOCK)
    generator = torch.Generator().manual_seed(context)
    k_cache, v_cache = torch.randn(2, blocks, BLOCK, kv_heads, dim, generator=generator).half()
    q = torch.randn(1, heads, dim, generator=generator)
    tables = torch.randperm(blocks, generator=generator).to(torch.int32)[None]
    lens = torch.tensor([context], dtype=torch.int32)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(CALLS):
            kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5)
        best = min(best, (time.perf_counter() - start) / CALLS)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 136, 200, 512])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = {
        "benchmark": "decode_attention",
        "cpu": cpu_model(),
        "commit": git_commit(),
        "threads": args.threads,
        "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "dim": args.dim, "cache": "float16"},
        "us_per_call": {
            str(n): round(best_call_us(n, args.heads, args.kv_heads, args.dim, args.reps), 1)
            for n in args.contexts
        },
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
