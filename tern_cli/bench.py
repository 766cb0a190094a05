"""``tern bench ...``: the gateway's and the engine's benchmarks, each printing JSON.

Each benchmark module is imported only when named, so ``tern bench gateway`` never imports torch,
and ``tern bench --help`` imports none of them.
"""

from __future__ import annotations

import sys

BENCHMARKS = {
    "gateway": (
        "bench.gateway.gateway",
        "the gateway's throughput and added latency (auth, limits, metering) over a stand-in engine",
    ),
    "gateway-ab": (
        "bench.gateway.ab",
        "the gateway's CPU per request, source trees side by side in one sitting (e.g. a parent commit)",
    ),
    "journal-sync": (
        "bench.gateway.journal_sync",
        "how long a usage journal batch waits for its sync: child process, kernel AIO, thread",
    ),
    "upstream-client": (
        "bench.gateway.upstream_client",
        "httpx against aiohttp for the gateway-to-engine hop",
    ),
    "prefix-routing": (
        "bench.gateway.prefix_routing",
        "cache-aware routing against round-robin: 2 engines, shared-prefix traffic, through a gateway",
    ),
    "engine": ("bench.engine.serving", "load test of a running engine: N concurrent streams"),
    "engine-hf": ("bench.engine.hf_baseline", "Hugging Face transformers generate, the engine's baseline"),
    "shared-prefix": (
        "bench.engine.shared_prefix",
        "a running engine on shared-system-prompt traffic (prefix cache)",
    ),
    "structured": (
        "bench.engine.structured",
        "structured output: grammar compile p50/p99, cache hits, what masks cost a mixed batch",
    ),
    "speculative": (
        "bench.engine.speculative",
        "n-gram speculative decoding on against off: input-grounded and open-ended, 1 and 16 streams",
    ),
    "speculative-ceiling": (
        "bench.engine.speculative_ceiling",
        "what speculation can gain here: step cost by draft rows; proposer, oracle, free draft rows replayed",
    ),
    "grammar-libraries": ("bench.engine.grammar_libraries", "llguidance against xgrammar (why llguidance)"),
    "kernels": ("bench.engine.kernels", "INT4 and ternary matmul kernels against half-precision matmul"),
    "kernel-tuning": (
        "bench.engine.kernel_tuning",
        "on a GPU: time each Triton kernel's configs at a model's shapes, write the tuning table",
    ),
    "cpu-linears": (
        "bench.engine.cpu_linears",
        "the default model's CPU linears: torch's kernels against the C kernels",
    ),
    "step-times": (
        "bench.engine.step_times",
        "one engine's steps one by one: CPU and wall ms by rows, the slowest steps, speculation on and off",
    ),
    "ggml-linears": (
        "bench.engine.ggml_linears",
        "GGUF block types (Q4_K, Q5_K, Q6_K, Q8_0) on the C kernels against the default model's q4_1",
    ),
    "int4-quality": ("bench.engine.int4_quality", "perplexity of RTN and AWQ INT4 models against float"),
    "gguf-quality": (
        "bench.engine.gguf_quality",
        "a GGUF served on the C kernels against the file dequantized to float32: perplexity, Paris",
    ),
    "engine-memory": (
        "bench.engine.memory",
        "an engine's resident memory phase by phase: imports, weights, KV pool, heap, after 16 streams",
    ),
}
"""Name: (module with ``main(argv)``, one line for ``tern bench --help``)."""


def usage() -> str:
    return f"usage: tern bench {{{','.join(BENCHMARKS)}}} [options]"


def help_text() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [usage(), "", "Benchmarks (each prints JSON; `tern bench NAME --help` for its options):"]
    lines += [f"  {name.ljust(width)}  {summary}" for name, (_, summary) in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(help_text())
        return 0
    if not argv or argv[0] not in BENCHMARKS:
        print(usage(), file=sys.stderr)
        return 2
    import importlib

    return int(importlib.import_module(BENCHMARKS[argv[0]][0]).main(argv[1:]) or 0)
