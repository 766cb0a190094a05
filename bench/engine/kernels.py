"""Quantized matmul benchmark: INT4 (W4A16) and ternary (BitNet) against torch's half-precision matmul.

    python -m bench.engine.kernels            # on CUDA: the Triton kernels, full Llama-3-8B shapes
    python -m bench.engine.kernels --quick    # the torch CPU paths, shapes scaled down 4x

Prints one JSON object: the device, the commit, and for every (kernel, shape, batch) the time,
the bytes a pass must read or write (weights + scales + activations + output), the achieved GB/s,
the percentage of the device's peak memory bandwidth (CUDA only, from a table of known parts) and
the speedup over torch's matmul with a dense fp16 (CUDA) / fp32 and bf16 (CPU) weight of the same
shape. Decode (batch 1-16) is bound by reading the weight, so GB/s is the figure that matters there.
Shapes are ``N x K`` (out x in features): Llama-3-8B's q/o, gate/up, down and lm_head.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from engine.layers.quant import Int4Linear, TernaryLinear
from engine.layers.quant.quantizers import absmean_ternarize, rtn_quantize

SHAPES: list[tuple[int, int]] = [(4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
BATCHES: list[int] = [1, 4, 16, 64]
GROUP_SIZE = 128
QUICK_SCALE = 4

# Peak HBM bandwidth of common parts, GB/s (vendor figures), matched against the device name.
PEAK_BANDWIDTH_GBS: dict[str, float] = {
    "H200": 4800.0,
    "H100 SXM": 3350.0,
    "H100 80GB HBM3": 3350.0,
    "H100 NVL": 3900.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,
    "L40S": 864.0,
    "L4": 300.0,
    "RTX 4090": 1008.0,
}


@dataclass
class Result:
    kernel: str
    n: int
    k: int
    batch: int
    time_us: float
    bytes_moved: int
    gbps: float
    pct_peak_bandwidth: float | None
    baseline: str
    baseline_time_us: float
    speedup: float


def peak_bandwidth(device_name: str) -> float | None:
    for part, gbs in PEAK_BANDWIDTH_GBS.items():
        if part in device_name:
            return gbs
    return None


def time_call(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds per call."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def quantized_layers(n: int, k: int, device: torch.device) -> dict[str, tuple[torch.nn.Module, int]]:
    """The layers to time, each with the bytes of its weight as stored."""
    # Random weights: speed does not depend on the values. Built on CPU, packed once for `device`.
    weight = torch.randn(n, k) * 0.02
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    int4 = Int4Linear(rtn_quantize(weight, GROUP_SIZE), device=device, dtype=dtype)
    ternary = TernaryLinear(absmean_ternarize(weight), device=device, dtype=dtype)
    int4_bytes = n * k // 2 + 2 * 2 * n * (k // GROUP_SIZE)  # codes + fp16 scales and mins
    ternary_bytes = n * k // 4 if device.type == "cuda" else n * k  # 2-bit on GPU, int8 on CPU
    return {"int4_g128": (int4, int4_bytes), "ternary": (ternary, ternary_bytes)}


def bench_shape(n: int, k: int, device: torch.device, reps: int) -> list[Result]:
    peak = peak_bandwidth(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    baselines = {"fp16": torch.float16} if device.type == "cuda" else {"fp32": torch.float32}
    if device.type == "cpu":
        baselines["bf16"] = torch.bfloat16
    dense = {name: torch.randn(n, k, device=device).to(dtype) * 0.02 for name, dtype in baselines.items()}
    act_dtype = torch.float16 if device.type == "cuda" else torch.float32
    layers = quantized_layers(n, k, device)
    results = []
    for batch in BATCHES:
        x = torch.randn(batch, k, device=device, dtype=act_dtype)
        inputs = {name: x.to(w.dtype) for name, w in dense.items()}
        baseline_times = {
            name: time_call(lambda w=w, xw=inputs[name]: torch.nn.functional.linear(xw, w), device, reps)
            for name, w in dense.items()
        }
        fastest = min(baseline_times, key=baseline_times.__getitem__)
        with torch.no_grad():
            for kernel, (layer, weight_bytes) in layers.items():
                seconds = time_call(lambda layer=layer, x=x: layer(x), device, reps)
                moved = weight_bytes + batch * (k + n) * x.element_size()
                gbps = moved / seconds / 1e9
                results.append(
                    Result(
                        kernel=kernel,
                        n=n,
                        k=k,
                        batch=batch,
                        time_us=round(seconds * 1e6, 2),
                        bytes_moved=moved,
                        gbps=round(gbps, 1),
                        pct_peak_bandwidth=None if peak is None else round(100 * gbps / peak, 1),
                        baseline=f"torch {fastest} matmul",
                        baseline_time_us=round(baseline_times[fastest] * 1e6, 2),
                        speedup=round(baseline_times[fastest] / seconds, 2),
                    )
                )
    return results


def git_commit() -> str | None:
    """HEAD's short hash; ``TERN_COMMIT`` where the tree was copied without its git directory."""
    if os.environ.get("TERN_COMMIT"):
        return os.environ["TERN_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help=f"shapes / {QUICK_SCALE} (default without CUDA)")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per case on CPU")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = args.quick or device.type == "cpu"
    shapes = [(n // QUICK_SCALE, k // QUICK_SCALE) for n, k in SHAPES] if quick else SHAPES
    torch.manual_seed(0)
    results = [r for n, k in shapes for r in bench_shape(n, k, device, args.reps)]
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": "triton" if device.type == "cuda" else "torch (CPU kernels)",
        "cpu_threads": torch.get_num_threads(),
        "commit": git_commit(),
        "quick": quick,
        "group_size": GROUP_SIZE,
        "peak_bandwidth_gbs": peak_bandwidth(torch.cuda.get_device_name(device))
        if device.type == "cuda"
        else None,
        "results": [asdict(r) for r in results],
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
