"""The engine served on CUDA end to end, with its decode rate set against the GPU's memory bandwidth.

    python -m bench.engine.cuda_serving --model r1b.gguf --quant int4 none bitnet

For each ``--quant`` it starts ``tern engine --device cuda`` on the model, waits for ``/health``, and
drives it over the internal RPC with the same clients as the CPU figures (``bench.engine.serving``:
1, 16 and 64 streams of greedy ``ignore_eos`` tokens, then 2k-token prompts; ``bench.engine.
shared_prefix``: shared system prompts through the radix cache). Prints one JSON object.

Memory bandwidth: a decode step reads every linear weight once, plus the output head, whatever the
batch; so at one stream ``tokens/s x weight bytes`` is the rate the weights are streamed at, and
``hbm_fraction`` sets it against the part's peak (``bench.engine.kernels.PEAK_BANDWIDTH_GBS``). KV
reads are left out (a few MB at these lengths), so the fraction is a slight underestimate. Weight
bytes per format: bf16 2 bytes a weight; int4 half a byte plus a bf16 scale and min per group of 128;
ternary (``--quant bitnet``) as the Triton kernel packs it, 2 bits (one scale per tensor). The head
stays bf16 in every format.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.engine import serving, shared_prefix
from bench.engine.kernels import git_commit, peak_bandwidth
from engine.loader import load_config
from engine.model_config import ModelConfig

GROUP_SIZE = 128


def linear_weights(config: ModelConfig) -> int:
    """Weights in the decoder layers' linears (q, k, v, o, gate, up, down), all layers."""
    h, d = config.hidden_size, config.head_dim
    attention = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    return config.num_hidden_layers * (attention + 3 * h * config.intermediate_size)


def weight_bytes_per_step(config: ModelConfig, quant: str) -> int:
    """Bytes a decode step must read: every linear weight (in its format) and the bf16 head."""
    n = linear_weights(config)
    per_format = {"none": 2.0 * n, "int4": n / 2 + n / GROUP_SIZE * 4, "bitnet": n / 4}
    head = 2 * config.vocab_size * config.hidden_size
    return int(per_format[quant] + head)


def wait_healthy(url: str, process: subprocess.Popen[bytes], deadline_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        if process.poll() is not None:
            raise RuntimeError(f"the engine exited with {process.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return time.monotonic() - start
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the engine was not healthy after {deadline_s} s")


def progress(quant: str, phase: str, figures: dict[str, Any]) -> None:
    """Each phase's figures as they come: a run cut short by a time limit keeps what it measured."""
    print(json.dumps({"quant": quant, "phase": phase, **figures}), file=sys.stderr, flush=True)


def gpu_memory_mib(pid: int) -> int | None:
    """GPU memory the engine process holds, as nvidia-smi reports it (None without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid):
            return int(fields[1])
    return None


def one_engine(args: argparse.Namespace, quant: str, peak_gbs: float | None) -> dict[str, Any]:
    url = f"http://127.0.0.1:{args.port}"
    command = [sys.executable, "-m", "tern_cli", "engine", "--device", args.device, "--model", args.model]
    command += ["--quant", quant, "--port", str(args.port), "--log-level", "warning"]
    command += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    log_path = Path(args.log_dir) / f"engine-{quant}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        try:
            result: dict[str, Any] = {"quant": quant, "load_s": round(wait_healthy(url, process, 600), 1)}
            progress(quant, "healthy", {"load_s": result["load_s"]})
            for streams, requests in ((1, 8), (16, 48), (64, 128)):
                run = serving.run(url, streams, requests, args.max_tokens, process.pid)
                result[f"streams_{streams}"] = asyncio.run(run)
                progress(quant, f"streams_{streams}", result[f"streams_{streams}"])
            long = serving.run(url, 1, 4, 1, None, 2048, tokenizer_path=args.model)
            result["prompt_2048"] = asyncio.run(long)
            progress(quant, "prompt_2048", result["prompt_2048"])
            workload = shared_prefix.Workload(
                num_groups=8,
                prompts_per_group=16,
                system_prompt_len=1024,
                question_len=64,
                output_len=32,
                token_range=(1000, 40000),
                seed=0,
            )
            result["shared_prefix"] = asyncio.run(shared_prefix.run(url, workload, 64))
            result["gpu_memory_mib"] = gpu_memory_mib(process.pid)
        finally:
            process.terminate()
            process.wait(timeout=60)
    config = load_config(args.model)
    step_bytes = weight_bytes_per_step(config, quant)
    result["weight_bytes_per_step"] = step_bytes
    for streams in (1, 16, 64):
        run_result = result[f"streams_{streams}"]
        itl_s = run_result["itl_p50_ms"] / 1000
        steps_per_s = 1 / itl_s if itl_s else 0.0
        gbs = step_bytes * steps_per_s / 1e9
        run_result["weight_read_gbs_at_itl_p50"] = round(gbs, 1)
        if peak_gbs:
            run_result["hbm_fraction"] = round(gbs / peak_gbs, 4)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a .gguf file or HF directory")
    p.add_argument("--quant", nargs="+", default=["int4", "none"], choices=["int4", "none", "bitnet"])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda", help="cpu only to try the harness on a small model")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--log-dir", default=".", help="where each engine's log is written")
    args = p.parse_args(argv)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    peak = peak_bandwidth(name)
    results: dict[str, Any] = {
        "device": name,
        "peak_bandwidth_gbs": peak,
        "commit": git_commit(),
        "model": os.path.basename(args.model),
        "engines": [],
    }
    for quant in args.quant:
        try:
            results["engines"].append(one_engine(args, quant, peak))
        except Exception as error:  # one format failing must not lose the others' figures
            trace = traceback.format_exc(limit=4)
            results["engines"].append({"quant": quant, "error": repr(error), "traceback": trace})
        print(json.dumps(results["engines"][-1]), file=sys.stderr, flush=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
