"""CPU linears of the default model: torch's weight-only kernels against the C kernels (engine/cpu).

    python -m bench.engine.cpu_linears [--threads 2] [--rows 1 4 9 16 128] [--repeats 5]

For SmolLM2-135M's shapes (stacked q/k/v, o, stacked gate/up, down: Q4_1 blocks of 32; the tied
Q8_0 lm_head), times ``Int4PackedCpuLinear`` / ``Int8PackedCpuLinear`` (torch's
``_weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm`` on bf16-rounded rows) and ``Q4CpuLinear`` /
``Q8CpuLinear`` on the same weights, interleaved in one process, best of ``--repeats`` windows (the
machine is shared: the best window is the least disturbed one). Prints one JSON object with µs per
call and the weight bytes each call reads per µs (GB/s), for every shape and row count, and
``decode_step_linears``: all 120 decoder linears of one step, each its own weight read from memory
(as serving reads them), in ms per step.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch
from torch import nn

from bench.engine.kernel_cli import kernel_bench_parser, kernels_ready, report
from engine.cpu import kernels as cpu_kernels
from engine.layers.packed_linear import Int4PackedCpuLinear, Int8PackedCpuLinear, Q4CpuLinear, Q8CpuLinear
from engine.layers.quant.linear import Int4Linear

SHAPES: dict[str, tuple[int, int]] = {
    "qkv": (576, 960),
    "o": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "lm_head": (576, 49152),
}
"""Name: (in features K, out features N), SmolLM2-135M's."""


def best_time(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Seconds per call, best window of ``repeats``."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def layers(name: str, k: int, n: int) -> tuple[nn.Module, nn.Module, int]:
    """(torch's kernel, the C kernel, weight bytes a C call reads) for one shape (float16 scales)."""
    if name == "lm_head":
        linear = nn.Linear(k, n, bias=False)
        return Int8PackedCpuLinear(linear), Q8CpuLinear(linear), n * k + n * k // 32 * 2
    int4 = Int4Linear.from_linear(nn.Linear(k, n, bias=False), group_size=32)
    return Int4PackedCpuLinear(int4), Q4CpuLinear(int4), n * k // 2 + 2 * n * k // 32 * 2


def decode_step_linears(rows_list: list[int], repeats: int, num_layers: int = 30) -> list[dict[str, object]]:
    """The decoder linears of one step of the whole model: ``num_layers`` copies of each shape, each
    its own weight, so every call reads its weight from memory as a served step does (the per-shape
    figures above repeat one call on a weight the cache keeps warm)."""
    decoder = [
        (k, *layers(name, k, n))
        for _ in range(num_layers)
        for name, (k, n) in SHAPES.items()
        if name != "lm_head"
    ]
    weight_bytes = sum(bytes_read for _, _, _, bytes_read in decoder)
    results: list[dict[str, object]] = []
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k) for k in {k for k, *_ in decoder}}

        def step(kernel: int, inputs: dict[int, torch.Tensor] = inputs) -> None:
            for k, *modules, _ in decoder:
                modules[kernel](inputs[k])

        torch_s = best_time(lambda: step(0), 1, repeats)
        c_s = best_time(lambda: step(1), 1, repeats)
        results.append(
            {
                "layers": num_layers,
                "rows": rows,
                "torch_ms": round(torch_s * 1e3, 2),
                "c_ms": round(c_s * 1e3, 2),
                "speedup": round(torch_s / c_s, 2),
                "c_weight_gb_s": round(weight_bytes / c_s / 1e9, 2),
            }
        )
    return results


def main(argv: list[str] | None = None) -> int:
    args = kernel_bench_parser(__doc__, rows=[1, 4, 9, 16, 128]).parse_args(argv)
    if not kernels_ready(args.threads):
        return 1
    torch.manual_seed(0)
    results = []
    with torch.inference_mode():
        for name, (k, n) in SHAPES.items():
            reference, c_kernel, weight_bytes = layers(name, k, n)
            for rows in args.rows:
                x = torch.randn(rows, k)
                calls = max(3, int(2e6 // (n * k // 32 * rows)))
                torch_s = best_time(lambda m=reference, x=x: m(x), calls, args.repeats)
                c_s = best_time(lambda m=c_kernel, x=x: m(x), calls, args.repeats)
                results.append(
                    {
                        "shape": name,
                        "k": k,
                        "n": n,
                        "rows": rows,
                        "torch_us": round(torch_s * 1e6, 1),
                        "c_us": round(c_s * 1e6, 1),
                        "speedup": round(torch_s / c_s, 2),
                        "torch_weight_gb_s": round(weight_bytes / torch_s / 1e9, 2),
                        "c_weight_gb_s": round(weight_bytes / c_s / 1e9, 2),
                    }
                )
        step = decode_step_linears(args.rows, args.repeats)
    kernel = "vnni, tile by tile" if cpu_kernels.q4_1_tiled() else "row by row"
    print(json.dumps(report("cpu_linears", q4_1_kernel=kernel, results=results, decode_step_linears=step)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
