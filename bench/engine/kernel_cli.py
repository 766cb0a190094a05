"""What the CPU kernel microbenchmarks (``cpu_linears``, ``ggml_linears``, ``ternary_linears``) share:
their common options, the check that the C kernels build here, and the head of their JSON report."""

from __future__ import annotations

import argparse
import json

import torch

from bench.engine import cpu_model
from bench.engine.kernels import git_commit
from engine.cpu import kernels as cpu_kernels


def kernel_bench_parser(doc: str | None, rows: list[int]) -> argparse.ArgumentParser:
    """``--threads``, ``--rows`` (default ``rows``) and ``--repeats``; a bench adds its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    parser.add_argument("--rows", type=int, nargs="+", default=rows)
    parser.add_argument("--repeats", type=int, default=5)
    return parser


def kernels_ready(threads: int | None) -> bool:
    """Whether the C kernels build here (else an error line is printed, as JSON); sets the threads."""
    if not cpu_kernels.available():
        print(json.dumps({"error": "the C kernels cannot be built here (no C compiler)"}))
        return False
    if threads:
        torch.set_num_threads(threads)
    return True


def report(benchmark: str, **fields: object) -> dict[str, object]:
    """The report's head (which benchmark, CPU, ISA, threads, commit) followed by ``fields``."""
    return {
        "benchmark": benchmark,
        "cpu": cpu_model(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "commit": git_commit(),
        **fields,
    }
