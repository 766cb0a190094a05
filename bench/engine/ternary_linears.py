"""Ternary (BitNet b1.58) linears on CPU: the ternary C kernel against the paths ternary weights took before.

    python -m bench.engine.ternary_linears [--threads 2] [--rows 1 16 128] [--layers 4] [--repeats 5]
        [--streamed MB] [--no-shapes]

For the decoder linears of two models (Llama-3.2-1B's shapes, the llama-architecture TQ2_0 benchmark
model; bitnet-b1.58-2B-4T's), with random ternary weights, times in one process, interleaved, best of
``--repeats`` windows (the machine is shared: the best window is the least disturbed one):

- ``tq2_rows``: ``TernaryCpuLinear`` with a scale per row (a BitNet checkpoint, or a TQ2_0 tensor whose
  blocks share one scale), two bits a weight;
- ``tq2_blocks``: the same with a float16 scale per block of 256 (TQ2_0 as llama-quantize writes it);
- ``int8_int_mm``: ``TernaryLinear``'s torch path (one int8 a weight, ``torch._int_mm``): how a BitNet
  checkpoint ran before;
- ``q8_0``: ``Q8CpuLinear`` on the dequantized weight: how a TQ2_0 GGUF ran before (requantized to 8 bits).

Prints one JSON object: µs per call per shape and row count, and ``layers``: ``--layers`` decoder layers
of each model, every linear its own weight (so a step reads them from memory, as serving does), in ms
per layer, with the weight bytes each kernel reads per layer.

``--streamed MB`` adds ``streamed``: each shape's ternary kernel (row and block scales) on enough copies
of its weight to fill MB of memory, called in turn (so every call reads its weight from memory, not
from the caches the per-shape figures run in): µs a call, wall and CPU (all threads), and the GB of
weight read a wall second and a CPU second (the CPU figure holds on a shared machine).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch
from torch import nn

from bench.engine.cpu_linears import best_time
from bench.engine.kernel_cli import kernel_bench_parser, kernels_ready, report
from engine.cpu import ternary
from engine.layers.packed_linear import Q8CpuLinear
from engine.layers.quant.linear import TernaryLinear
from engine.layers.quant.weights import TernaryWeight
from engine.layers.ternary_linear import TernaryCpuLinear

MODELS: dict[str, dict[str, tuple[int, int]]] = {
    "llama-3.2-1b": {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048)},
    "bitnet-b1.58-2b": {
        "qkv": (2560, 3840),
        "o": (2560, 2560),
        "gate_up": (2560, 13824),
        "down": (6912, 2560),
    },
}
"""Model: {linear (q/k/v and gate/up stacked, as served): (in features K, out features N)}."""
KERNELS = ("tq2_rows", "tq2_blocks", "int8_int_mm", "q8_0")


def ternary_linears(k: int, n: int, seed: int) -> dict[str, tuple[nn.Module, int]]:
    """The ternary kernel's modules (row and block scales) on one random ternary weight, with the
    weight bytes a call reads."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(-1, 2, (n, k), generator=generator, dtype=torch.int8)
    codes = ternary.pack_tq2(values)
    block_scales = (torch.rand(n, k // ternary.QK, generator=generator) * 0.01 + 0.015).half()
    return {
        "tq2_rows": (TernaryCpuLinear.from_ternary(TernaryWeight(values, scale=0.02)), n * k // 4 + 4 * n),
        "tq2_blocks": (TernaryCpuLinear(codes, k, block_scales=block_scales), n * k // 4 + 2 * n * k // 256),
    }


def linears(k: int, n: int, seed: int) -> dict[str, tuple[nn.Module, int]]:
    """Each kernel's module on one random ternary weight, with the weight bytes a call reads."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(-1, 2, (n, k), generator=generator, dtype=torch.int8)
    weight = TernaryWeight(values, scale=0.02)
    dense = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        dense.weight.copy_(weight.dequantize())
    q8 = Q8CpuLinear(dense)
    del dense
    return ternary_linears(k, n, seed) | {
        "int8_int_mm": (TernaryLinear(weight, backend="torch"), n * k),
        "q8_0": (q8, n * k + 2 * n * k // 32),
    }


def per_shape(rows_list: list[int], repeats: int) -> list[dict[str, object]]:
    results: list[dict[str, object]] = []
    for model, shapes in MODELS.items():
        for name, (k, n) in shapes.items():
            modules = linears(k, n, seed=k + n)
            for rows in rows_list:
                x = torch.randn(rows, k)
                calls = max(2, int(5e7 // (n * k * rows) + 1))
                times = {
                    kernel: best_time(lambda m=module, x=x: m(x), calls, repeats)
                    for kernel, (module, _) in modules.items()
                }
                results.append(
                    {"model": model, "shape": name, "k": k, "n": n, "rows": rows}
                    | {f"{kernel}_us": round(s * 1e6, 1) for kernel, s in times.items()}
                    | {"tq2_rows_speedup_vs_q8_0": round(times["q8_0"] / times["tq2_rows"], 2)}
                    | {"tq2_rows_speedup_vs_int8_int_mm": round(times["int8_int_mm"] / times["tq2_rows"], 2)}
                )
    return results


def per_layer(rows_list: list[int], num_layers: int, repeats: int) -> list[dict[str, object]]:
    """``num_layers`` layers of each model, every linear its own weight: ms per layer and bytes read."""
    results: list[dict[str, object]] = []
    for model, shapes in MODELS.items():
        built = [
            (k, linears(k, n, seed=1000 * layer + i))
            for layer in range(num_layers)
            for i, (k, n) in enumerate(shapes.values())
        ]
        layer_bytes = {kernel: sum(m[kernel][1] for _, m in built) // num_layers for kernel in KERNELS}
        for rows in rows_list:
            inputs = {k: torch.randn(rows, k) for k, _ in built}

            def step(
                kernel: str, inputs: dict[int, torch.Tensor] = inputs, built: list = built
            ) -> Callable[[], None]:
                def run() -> None:
                    for k, modules in built:
                        modules[kernel][0](inputs[k])

                return run

            times = {kernel: best_time(step(kernel), 1, repeats) / num_layers for kernel in KERNELS}
            results.append(
                {"model": model, "rows": rows}
                | {f"{kernel}_ms": round(s * 1e3, 3) for kernel, s in times.items()}
                | {f"{kernel}_weight_mb": round(b / 1e6, 1) for kernel, b in layer_bytes.items()}
                | {
                    f"{kernel}_weight_gb_s": round(layer_bytes[kernel] / s / 1e9, 2)
                    for kernel, s in times.items()
                }
            )
        del built
    return results


def streamed(rows_list: list[int], repeats: int, megabytes: int) -> list[dict[str, object]]:
    """The ternary kernel per shape, each call on the next of enough weights to fill ``megabytes``."""
    results: list[dict[str, object]] = []
    for model, shapes in MODELS.items():
        for name, (k, n) in shapes.items():
            copies = max(2, megabytes * 10**6 // (n * k // 4))
            built = [ternary_linears(k, n, seed=k + n + i) for i in range(copies)]
            for rows in rows_list:
                x = torch.randn(rows, k)
                row: dict[str, object] = {"model": model, "shape": name, "k": k, "n": n, "rows": rows}
                for kernel in ("tq2_rows", "tq2_blocks"):
                    modules = [b[kernel][0] for b in built]
                    weight_bytes = built[0][kernel][1]
                    wall, cpu = float("inf"), float("inf")
                    for _ in range(repeats):
                        start, start_cpu = time.perf_counter(), time.process_time()
                        for module in modules:
                            module(x)
                        wall = min(wall, (time.perf_counter() - start) / copies)
                        cpu = min(cpu, (time.process_time() - start_cpu) / copies)
                    row |= {
                        f"{kernel}_us": round(wall * 1e6, 1),
                        f"{kernel}_cpu_us": round(cpu * 1e6, 1),
                        f"{kernel}_gb_s": round(weight_bytes / wall / 1e9, 2),
                        f"{kernel}_gb_cpu_s": round(weight_bytes / cpu / 1e9, 2),
                    }
                results.append(row)
            del built
    return results


def main(argv: list[str] | None = None) -> int:
    parser = kernel_bench_parser(__doc__, rows=[1, 16, 128])
    parser.add_argument(
        "--layers", type=int, default=4, help="decoder layers per model in the per-layer figures"
    )
    parser.add_argument(
        "--streamed", type=int, default=0, metavar="MB", help="per shape, weights read from memory (0: off)"
    )
    parser.add_argument("--no-shapes", action="store_true", help="leave out the per-shape figures")
    args = parser.parse_args(argv)
    if not kernels_ready(args.threads):
        return 1
    with torch.inference_mode():
        shapes = [] if args.no_shapes else per_shape(args.rows, args.repeats)
        layers = per_layer(args.rows, args.layers, args.repeats) if args.layers else []
        from_memory = streamed(args.rows, args.repeats, args.streamed) if args.streamed else []
    print(json.dumps(report("ternary_linears", results=shapes, layers=layers, streamed=from_memory)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
