"""``tern bench ...``: the gateway's and the engine's benchmarks, each printing JSON.

:data:`BENCHMARKS` is the index of the benchmarks: each entry names its module, the claim in the docs
it backs (a ``docs/<page>.md#anchor``) and the folder its committed results live in
(``docs/benchmarks/<name>/<cpu-or-gpu>-<commit>/``). docs/benchmarks.md lists the same entries, and
``tests/test_bench_registry.py`` holds the two together, as ``tests/test_import_contract.py`` holds the
packages' arrows to the docs. :data:`HELPERS` names every other file in ``bench/`` and the benchmark
it serves; :data:`RETIRED` the benchmarks removed, with the commit their script can be read at.

Each benchmark module is imported only when named, so ``tern bench gateway`` never imports torch,
and ``tern bench --help`` imports none of them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Bench:
    module: str
    """Has ``main(argv) -> int``."""
    summary: str
    """One line for ``tern bench --help``."""
    claim: str
    """The docs section whose figures it measures: ``docs/<page>.md#<anchor>``."""
    results: bool = True
    """Its committed results are under ``docs/benchmarks/<name>/`` (False: none are committed)."""


BENCHMARKS: dict[str, Bench] = {
    "gateway": Bench(
        "bench.gateway.gateway",
        "the gateway's throughput and added latency (auth, limits, metering) over a stand-in engine",
        "docs/gateway.md#figures-on-an-idle-machine-the-ones-to-quote",
    ),
    "gateway-ab": Bench(
        "bench.gateway.ab",
        "the gateway's CPU per request, source trees side by side in one sitting (e.g. a parent commit)",
        "docs/limits-and-billing.md#when-the-gateway-process-dies",
    ),
    "journal-sync": Bench(
        "bench.gateway.journal_sync",
        "how long a usage journal batch waits for its sync: child process against thread",
        "docs/limits-and-billing.md#when-the-gateway-process-dies",
        results=False,
    ),
    "prefix-routing": Bench(
        "bench.gateway.prefix_routing",
        "cache-aware routing against round-robin: 2 engines, shared-prefix traffic, through a gateway",
        "docs/gateway.md#prefix-cache-aware-routing",
    ),
    "engine": Bench(
        "bench.engine.serving",
        "load test of a running engine: N concurrent streams",
        "docs/engine.md#benchmarks",
    ),
    "engine-hf": Bench(
        "bench.engine.hf_baseline",
        "Hugging Face transformers generate, the engine's baseline",
        "docs/engine.md#benchmarks",
        results=False,  # its runs sit beside the engine's, in docs/benchmarks/engine/
    ),
    "engine-vs-llamacpp": Bench(
        "bench.engine.vs_llamacpp",
        "the engine against llama.cpp's llama-server on the same GGUF: 1 and 16 streams, long prompts, RSS",
        "docs/engine.md#side-by-side-with-llamacpp-the-cpu-fast-path",
    ),
    "shared-prefix": Bench(
        "bench.engine.shared_prefix",
        "a running engine on shared-system-prompt traffic (prefix cache)",
        "docs/engine.md#benchmark-shared-prefixes",
        results=False,
    ),
    "structured": Bench(
        "bench.engine.structured",
        "structured output: grammar compile p50/p99, cache hits, what masks cost a mixed batch",
        "docs/structured-output.md#measured",
    ),
    "speculative": Bench(
        "bench.engine.speculative",
        "n-gram speculative decoding on against off: input-grounded and open-ended, 1 and 16 streams",
        "docs/engine.md#measured-speculation-on-against-off",
    ),
    "kernels": Bench(
        "bench.engine.kernels",
        "INT4 and ternary matmul kernels against half-precision matmul",
        "docs/quantization.md#benchmark",
        results=False,
    ),
    "kernel-tuning": Bench(
        "bench.engine.kernel_tuning",
        "on a GPU: time each Triton kernel's configs at a model's shapes, write the tuning table",
        "docs/engine.md#triton-kernels-on-a-gpu-tuning-table-warm-up-graphs",
        results=False,
    ),
    "cuda-serving": Bench(
        "bench.engine.cuda_serving",
        "on a GPU: the engine served end to end, its decode rate against the memory bandwidth",
        "docs/engine.md#triton-kernels-on-a-gpu-tuning-table-warm-up-graphs",
    ),
    "cpu-linears": Bench(
        "bench.engine.cpu_linears",
        "the default model's CPU linears: torch's kernels against the C kernels",
        "docs/engine.md#cpu-linears",
    ),
    "step-times": Bench(
        "bench.engine.step_times",
        "one engine's steps one by one: CPU and wall ms by rows, the slowest steps, speculation on and off",
        "docs/engine.md#where-a-steps-time-goes-and-what-changed",
        results=False,
    ),
    "decode-step": Bench(
        "bench.engine.decode_step",
        "one stream's decode step in process: wall and CPU ms a token, after a prefill",
        "docs/engine.md#int8-activations-on-the-k-quant-tiles-the-prompt-path-issue-34",
        results=False,
    ),
    "decode-attention": Bench(
        "bench.engine.decode_attention",
        "one decode row's paged attention on the C kernel: microseconds a call by context length",
        "docs/quantization.md#one-parallel-region-for-the-ternary-layers-01e0dec-e3a70aa-c1169d5",
        results=False,
    ),
    "ggml-linears": Bench(
        "bench.engine.ggml_linears",
        "GGUF block types (Q4_K, Q5_K, Q6_K, Q8_0) on the C kernels against the default model's q4_1",
        "docs/engine.md#gguf-types-which-kernel-runs-each-ggml-type",
    ),
    "int4-quality": Bench(
        "bench.engine.int4_quality",
        "perplexity of RTN and AWQ INT4 models against float",
        "docs/quantization.md#measured-quality-smollm2-135m-instruct-int4-g128-cpu-float32",
    ),
    "gguf-quality": Bench(
        "bench.engine.gguf_quality",
        "a GGUF served on the C kernels against the file dequantized to float32: perplexity, Paris",
        "docs/engine.md#gguf-types-which-kernel-runs-each-ggml-type",
        results=False,  # its runs sit with the kernels they checked, in docs/benchmarks/ggml-linears/
    ),
    "engine-memory": Bench(
        "bench.engine.memory",
        "an engine's resident memory phase by phase: imports, weights, KV pool, heap, after 16 streams",
        "docs/engine.md#resident-memory",
    ),
    "long-context-memory": Bench(
        "bench.engine.long_context_memory",
        "resident memory with 16 streams of 4k-token contexts: Tern against llama-server, one at a time",
        "docs/engine.md#gemma-3-1b-16-streams-of-4k-token-contexts-resident-memory",
    ),
}
"""Name: what it runs, what it backs, whether its results are committed."""

HELPERS: dict[str, str] = {
    "bench/gateway/standin.py": "gateway",
    "bench/engine/__main__.py": "engine",
    "bench/engine/long_prompts.py": "engine-vs-llamacpp",
    "bench/engine/openai_load.py": "engine-vs-llamacpp",
    "bench/engine/peer_prompts.json": "engine-vs-llamacpp",
    "bench/engine/random_gguf.py": "engine-vs-llamacpp",
    "bench/engine/random_hf.py": "engine-vs-llamacpp",
    "bench/engine/random_family_ggufs.sh": "engine-vs-llamacpp",
    "bench/engine/engine_ab.sh": "engine-vs-llamacpp",
    "bench/engine/make_bitnet_gguf.py": "engine-vs-llamacpp",
    "bench/engine/make_bitnet_hf.py": "engine-vs-llamacpp",
    "bench/engine/convert_bitnet_hf.py": "engine-vs-llamacpp",
    "bench/engine/kernel_cli.py": "cpu-linears",
    "bench/engine/cuda_check.sh": "cuda-serving",
    "bench/engine/cuda_check.py": "cuda-serving",
    "bench/engine/cuda_parity.py": "cuda-serving",
}
"""Every other file in bench/ (a stand-in, a model maker, a client, a driver): the benchmark it serves."""

RETIRED: dict[str, str] = {
    "grammar-libraries": "1a012e0",
    "upstream-client": "1a012e0",
    "speculative-ceiling": "1a012e0",
    "ternary-linears": "6a279d7",
}
"""Benchmarks retired once their results were in the docs: the commit their script is at. Their
results stay in ``docs/benchmarks/<name>/``."""


def usage() -> str:
    return f"usage: tern bench {{{','.join(BENCHMARKS)}}} [options]"


def help_text() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [usage(), "", "Benchmarks (each prints JSON; `tern bench NAME --help` for its options):"]
    lines += [f"  {name.ljust(width)}  {bench.summary}" for name, bench in BENCHMARKS.items()]
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

    return int(importlib.import_module(BENCHMARKS[argv[0]].module).main(argv[1:]) or 0)
