"""GGUF block types on the C kernels: each GGML type's kernel against the default model's q4_1 one.

    python -m bench.engine.ggml_linears [--threads 2] [--rows 1 16 512] [--layers 4] [--repeats 5]
        [--shapes llama-3.2-1b|smollm2-135m] [--kernels q5_0 q8_0 ...]

For Llama-3.2-1B's decoder linears (q/k/v and gate/up stacked, as served; ``--shapes smollm2-135m``: the
default model's, whose 576-wide ones a Q4_K_M file holds as Q5_0), random weights, times in one
process, interleaved, best of ``--repeats`` windows (the machine is shared: the best window is the least
disturbed one), per call: ``{kernel}_us`` wall µs, ``{kernel}_cpu_us`` CPU µs of all the process's threads
(what a shared machine does not inflate, but OpenMP's waiting threads count: compare kernels on it at
``--threads 1``), ``{kernel}_gb_s`` weight bytes over the CPU time (GB a CPU-second: one thread's
effective bandwidth at one row, where the weight, read again and again, may sit in the cache), for
``q4_1`` (``Q4CpuLinear``, the kernel the default model runs), and ``GgmlLinear`` on ``q4_k``,
``q5_k``, ``q6_k``, ``q8_0``, ``q5_0`` blocks (tile by tile where the CPU has AVX2, as the loader
keeps them) and ``q4_k_rows`` / ``q6_k_rows`` / ``q8_0_rows`` / ``q5_0_rows`` (their row-by-row
kernels, what other CPUs run).

``layers``: ``--layers`` decoder layers, every linear its own weight (so a step reads them from memory, as
serving does), ms per layer and GB/s of weight read, for a layer of each type and for a Q4_K_M layer
(q/k/v, o, gate/up Q4_K, down Q6_K, as llama-quantize writes half of a Q4_K_M file's layers).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable

import torch
from torch import nn

from bench.engine.cpu_linears import best_time
from bench.engine.kernel_cli import kernel_bench_parser, kernels_ready, report
from engine.cpu import ggml_kernels
from engine.cpu.ggml_kernels import GGMLType
from engine.layers.ggml_linear import GgmlLinear
from engine.layers.packed_linear import Q4CpuLinear
from engine.layers.quant.linear import Int4Linear

MODEL_SHAPES = {
    "llama-3.2-1b": {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048)},
    "smollm2-135m": {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)},
}
"""Each model's decoder linears: (in features K, out features N)."""
TYPES = {
    "q4_k": GGMLType.Q4_K,
    "q4_k_rows": GGMLType.Q4_K,
    "q5_k": GGMLType.Q5_K,
    "q6_k": GGMLType.Q6_K,
    "q6_k_rows": GGMLType.Q6_K,
    "q8_0": GGMLType.Q8_0,
    "q8_0_rows": GGMLType.Q8_0,
    "q5_0": GGMLType.Q5_0,
    "q5_0_rows": GGMLType.Q5_0,
}
KERNELS = ("q4_1", *TYPES)


def linear(kernel: str, k: int, n: int, seed: int) -> tuple[nn.Module, int]:
    """One kernel's module on a random weight, with the weight bytes a call reads."""
    if kernel == "q4_1":
        int4 = Int4Linear.from_linear(nn.Linear(k, n, bias=False), group_size=32)
        return Q4CpuLinear(int4), n * k // 2 + 2 * n * k // 32 * 2
    ggml_type = TYPES[kernel]
    blocks = torch.from_numpy(ggml_kernels.random_blocks(ggml_type, n, k, seed))
    return GgmlLinear(blocks, ggml_type, k, tile=not kernel.endswith("_rows")), blocks.numel()


def best_times(fn: Callable[[], object], calls: int, repeats: int) -> tuple[float, float]:
    """(wall, CPU) seconds per call, each the best window of ``repeats``."""
    fn()
    wall = cpu = float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            fn()
        wall = min(wall, (time.perf_counter() - start) / calls)
        cpu = min(cpu, (time.process_time() - start_cpu) / calls)
    return wall, cpu


def per_shape(
    rows_list: list[int], repeats: int, shapes: dict[str, tuple[int, int]], kernels: tuple[str, ...]
) -> list[dict[str, object]]:
    results: list[dict[str, object]] = []
    for name, (k, n) in shapes.items():
        modules = {kernel: linear(kernel, k, n, seed=k + n) for kernel in kernels}
        for rows in rows_list:
            x = torch.randn(rows, k)
            calls = max(2, int(5e7 // (n * k * rows) + 1))
            times: dict[str, list[tuple[float, float]]] = {kernel: [] for kernel in modules}
            for _ in range(repeats):  # kernel by kernel, window by window: interleaved
                for kernel, (module, _) in modules.items():
                    times[kernel].append(best_times(functools.partial(module, x), calls, 1))
            row: dict[str, object] = {"shape": name, "k": k, "n": n, "rows": rows}
            for kernel, (_, size) in modules.items():
                wall, cpu = min(t[0] for t in times[kernel]), min(t[1] for t in times[kernel])
                row |= {
                    f"{kernel}_us": round(wall * 1e6, 1),
                    f"{kernel}_cpu_us": round(cpu * 1e6, 1),
                    f"{kernel}_gb_s": round(size / cpu / 1e9, 2),
                }
            results.append(row)
    return results


def per_layer(
    rows_list: list[int],
    num_layers: int,
    repeats: int,
    shapes: dict[str, tuple[int, int]],
    kernels: tuple[str, ...],
) -> list[dict[str, object]]:
    """``num_layers`` layers of each kind, every linear its own weight: ms per layer and weight GB/s."""
    kinds = {kernel: dict.fromkeys(shapes, kernel) for kernel in kernels}
    if all(k % 256 == 0 for k, _ in shapes.values()):  # else llama-quantize writes Q5_0 for Q4_K
        kinds["q4_k_m"] = dict.fromkeys(shapes, "q4_k") | {"down": "q6_k"}
    results: list[dict[str, object]] = []
    for kind, per_linear in kinds.items():
        built = [
            (k, *linear(per_linear[name], k, n, seed=1000 * layer + i))
            for layer in range(num_layers)
            for i, (name, (k, n)) in enumerate(shapes.items())
        ]
        layer_bytes = sum(size for _, _, size in built) // num_layers
        for rows in rows_list:
            inputs = {k: torch.randn(rows, k) for k, _, _ in built}

            def step(inputs: dict[int, torch.Tensor] = inputs, built: list = built) -> Callable[[], None]:
                def run() -> None:
                    for k, module, _ in built:
                        module(inputs[k])

                return run

            seconds = best_time(step(), 1, repeats) / num_layers
            results.append(
                {"layer": kind, "rows": rows, "ms": round(seconds * 1e3, 3)}
                | {
                    "weight_mb": round(layer_bytes / 1e6, 1),
                    "weight_gb_s": round(layer_bytes / seconds / 1e9, 2),
                }
            )
        del built
    return results


def main(argv: list[str] | None = None) -> int:
    parser = kernel_bench_parser(__doc__, rows=[1, 16, 512])
    parser.add_argument(
        "--layers", type=int, default=4, help="decoder layers per kind in the per-layer figures"
    )
    parser.add_argument("--no-shapes", action="store_true", help="only the per-layer figures")
    parser.add_argument("--shapes", choices=sorted(MODEL_SHAPES), default="llama-3.2-1b")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    args = parser.parse_args(argv)
    if not kernels_ready(args.threads):
        return 1
    model, chosen = MODEL_SHAPES[args.shapes], tuple(args.kernels)
    with torch.inference_mode():
        shapes = [] if args.no_shapes else per_shape(args.rows, args.repeats, model, chosen)
        layers = per_layer(args.rows, args.layers, args.repeats, model, chosen) if args.layers else []
    fields = {"shapes": args.shapes, "tiled": ggml_kernels.tiled_isa(), "results": shapes, "layers": layers}
    print(json.dumps(report("ggml_linears", **fields)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
