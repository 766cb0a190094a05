"""Fill the Triton kernels' tuning table for this GPU: ``tern bench kernel-tuning --model M``.

    tern bench kernel-tuning --quant int4 bitnet [--model r1b.gguf] [--out table.json]

For each ``--quant`` it builds the engine on CUDA (graphs off), whose warm-up launches every kernel at
the model's own (kernel, N, K, M bucket) keys: the keys the request path will look up
(``engine/kernels/tuning.py``). Then, for each key, it runs every config of the kernel's space at that
shape (M = the bucket's top), checks each against the plain-torch reference, times the correct
ones with ``triton.testing.do_bench`` and writes the fastest into the table under this GPU's name
and Triton version, keeping other GPUs' entries. Prints one JSON object: per key the default's and
the best config's time.

This is the only place configs are searched: offline, on the GPU that will serve. Commit the table
(``engine/kernels/tuning_table.json``) and the printed JSON under docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton

from engine.kernels import tuning
from engine.kernels.int4_matmul import int4_matmul_ref, launch_int4, pack_int4
from engine.kernels.ternary_matmul import (
    launch_quantize,
    launch_ternary,
    pack_ternary,
    quantize_activations_ref,
    ternary_matmul_ref,
)
from engine.kernels.tuning import SPACES, LaunchConfig, TuningTable

Timer = Callable[[Callable[[], object]], float]
"""Milliseconds one call of the function takes (``triton.testing.do_bench`` on a GPU)."""
Key = tuple[str, int, int, int]
"""(kernel, N, K, M bucket), as ``Chooser.chosen`` records them."""


def wall_timer(fn: Callable[[], object]) -> float:
    """One call by the wall clock: for the CPU interpreter, where only the fill logic is under test."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def gpu_timer(fn: Callable[[], object]) -> float:
    """Triton's GPU timer: the median of many runs after a warm-up, caches flushed between runs."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50))


def _case(
    key: Key, device: str, dtype: torch.dtype
) -> tuple[Callable[[LaunchConfig], torch.Tensor], torch.Tensor]:
    """A launch of the key's kernel at its shape as a function of the config, and the reference."""
    kernel, n, k, m = key
    gen = torch.Generator().manual_seed(n * 31 + k)
    x = torch.randn((m, k), generator=gen).to(device, dtype)
    if kernel.startswith("int4_"):
        group = int(kernel.split("_")[1][1:])
        groups = -(-k // group)
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        scales = torch.rand((n, groups), generator=gen) * 0.02 + 0.01
        qw, sc, mn = (t.to(device) for t in pack_int4(codes, scales, -8 * scales, group))

        def int4(config: LaunchConfig) -> torch.Tensor:
            out = torch.zeros((m, n), device=device, dtype=torch.float32 if config["SPLIT_K"] > 1 else dtype)
            launch_int4(x, qw, sc, mn, out, group, config)
            return out

        return int4, int4_matmul_ref(x, qw, sc, mn, group)
    if kernel == "ternary_quantize":

        def quantize(config: LaunchConfig) -> torch.Tensor:
            xq = torch.empty((m, k), device=device, dtype=torch.int8)
            launch_quantize(x, xq, torch.empty(m, device=device, dtype=torch.float32), config)
            return xq

        return quantize, quantize_activations_ref(x)[0].to(device)
    qweight = pack_ternary(torch.randint(-1, 2, (n, k), generator=gen)).to(device)
    w_scale = torch.tensor([0.02], device=device)
    xq, x_scale = (t.to(device) for t in quantize_activations_ref(x))

    def ternary(config: LaunchConfig) -> torch.Tensor:
        out = torch.zeros((m, n), device=device, dtype=torch.float32 if config["SPLIT_K"] > 1 else dtype)
        launch_ternary(xq, x_scale, qweight, w_scale, out, config)
        return out

    return ternary, ternary_matmul_ref(x, qweight, w_scale)


def _matches(out: torch.Tensor, ref: torch.Tensor) -> bool:
    if out.dtype == torch.int8:  # a rounding tie may land one step apart (a last-ulp scale difference)
        return bool((out.int() - ref.int()).abs().max() <= 1)
    scale = ref.float().abs().max().item() or 1.0
    return bool(torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * scale))


def tune_key(key: Key, timer: Timer, device: str, dtype: torch.dtype) -> dict[str, Any]:
    """Every candidate of the key's space, checked then timed: ``{"best": config, "ms": {name: ms}}``."""
    run, ref = _case(key, device, dtype)
    timings: dict[str, float] = {}
    wrong: list[str] = []
    best: LaunchConfig | None = None
    for config in SPACES[key[0]].candidates():
        if not _matches(run(config), ref):
            wrong.append(config.name)  # never chosen; reported so the space can be fixed
            continue
        timings[config.name] = timer(functools.partial(run, config))
        if best is None or timings[config.name] < timings[best.name]:
            best = config
    return {"best": best, "ms": timings, "wrong": wrong}


def tune(
    keys: list[Key], table: TuningTable, gpu: str, timer: Timer, device: str, dtype: torch.dtype
) -> list[dict]:
    """Tune each key with candidates to choose from into ``table``; one report row per key."""
    rows = []
    for key in sorted(set(keys)):
        kernel, n, k, bucket = key
        if not SPACES[kernel].configs:
            continue  # nothing to choose: the default is the only config
        result = tune_key(key, timer, device, dtype)
        best: LaunchConfig | None = result["best"]
        default_ms = result["ms"].get(SPACES[kernel].default.name)
        if best is not None:
            table.entries[(kernel, gpu, triton.__version__, n, k, bucket)] = best
        rows.append(
            {"kernel": kernel, "n": n, "k": k, "m_bucket": bucket, "default_ms": default_ms,
             "best": None if best is None else best.name,
             "best_ms": None if best is None else result["ms"][best.name], "wrong": result["wrong"]}
        )  # fmt: skip
    return rows


def model_keys(model: str | None, quant: str, max_num_seqs: int, max_batched: int) -> list[Key]:
    """The keys the engine's warm-up launches for ``model`` with ``quant`` on CUDA."""
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine

    tuning.set_chooser(None)
    config = EngineConfig(model=model, device="cuda", quant=quant, cuda_graphs=False, speculative="off",
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched)  # fmt: skip
    engine = LLMEngine.from_config(config)
    keys = list(tuning.chooser().chosen())
    del engine
    torch.cuda.empty_cache()
    return keys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tern bench kernel-tuning", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model path (default: the default SmolLM2 GGUF)")
    p.add_argument("--quant", nargs="+", default=["int4", "bitnet"], choices=["int4", "bitnet"])
    p.add_argument("--max-num-seqs", type=int, default=64, help="decode batch sizes warmed up, as served")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument(
        "--out", type=Path, default=tuning.TABLE_PATH, help="table to update (default: the committed one)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel-tuning needs a CUDA GPU: it times configs on the part that will serve", file=sys.stderr)
        return 2
    table = TuningTable.load(args.out)
    gpu = tuning.device_name()
    report: dict[str, Any] = {
        "gpu": gpu,
        "triton": triton.__version__,
        "torch": torch.__version__,
        "runs": {},
    }
    for quant in args.quant:
        keys = model_keys(args.model, quant, args.max_num_seqs, args.max_num_batched_tokens)
        report["runs"][quant] = tune(keys, table, gpu, gpu_timer, "cuda", torch.bfloat16)
        table.save(args.out, about=ABOUT)
        print(json.dumps({quant: report["runs"][quant]}), flush=True)  # a cut run keeps what it measured
    print(json.dumps(report, indent=1))
    return 0


ABOUT = (
    "Best launch config per (kernel, GPU, Triton version, N, K, M bucket), measured by "
    "`tern bench kernel-tuning` (engine/kernels/tuning.py, docs/engine.md)."
)
