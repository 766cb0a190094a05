"""Two phases of ``bench/engine/cuda_check.sh``: an engine's start-up, and the targets of issue 50.

    python -m bench.engine.cuda_check ready --model r1b.gguf --quant int4     # one JSON line
    python -m bench.engine.cuda_check targets serving.json                    # one JSON line

``ready`` starts ``tern engine`` and times, from the process start, ``/health`` answering (its
warm-up included) and the first streamed token of a first request; then the radix cache's time to
first token on prompts that share a long prefix with an earlier one (hit) against fresh ones (miss).
Run twice, the second start finds Triton's on-disk cache filled by the first (``warm``).

``targets`` reads ``bench.engine.cuda_serving``'s JSON and sets its figures against the targets:
INT4 decode at one stream reading weights at >= 40% of HBM peak, ternary >= 3x bf16's tokens/s at
one stream, 64 streams >= 10x one stream's total tokens/s.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.engine.cuda_serving import wait_healthy


def served_model(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])


def first_token_s(url: str, model: str, prompt: str, max_tokens: int = 8) -> float:
    """Seconds from sending a streamed completion to its first token."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.monotonic() - start
    raise RuntimeError("the stream ended without a token")


def words(n: int, rng: random.Random) -> str:
    vocabulary = "the of engine cache token graph kernel model step batch stream prefix ready".split()
    return " ".join(rng.choice(vocabulary) + str(rng.randrange(100)) for _ in range(n))


def radix_ttft(url: str, pairs: int, prefix_words: int) -> dict[str, Any]:
    """Per pair, a fresh long prompt (miss), then the same prefix with another question (hit)."""
    rng = random.Random(0)
    model = served_model(url)
    miss, hit = [], []
    for _ in range(pairs):
        prefix = words(prefix_words, rng)
        miss.append(first_token_s(url, model, prefix + " question: " + words(8, rng)))
        hit.append(first_token_s(url, model, prefix + " question: " + words(8, rng)))
    p50_miss, p50_hit = statistics.median(miss), statistics.median(hit)
    return {
        "pairs": pairs,
        "prefix_words": prefix_words,
        "ttft_miss_p50_ms": round(p50_miss * 1e3, 1),
        "ttft_hit_p50_ms": round(p50_hit * 1e3, 1),
        "hit_speedup": round(p50_miss / p50_hit, 2) if p50_hit else None,
    }


def ready(args: argparse.Namespace) -> dict[str, Any]:
    url = f"http://127.0.0.1:{args.port}"
    command = [sys.executable, "-m", "tern_cli", "engine", "--device", args.device, "--model", args.model]
    command += ["--quant", args.quant, "--port", str(args.port), "--log-level", "info"]
    command += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    result: dict[str, Any] = {"quant": args.quant, "label": args.label}
    log_path = Path(args.log_dir) / f"ready-{args.quant}-{args.label}.log"
    with log_path.open("wb") as log:
        start = time.monotonic()
        process = subprocess.Popen(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        try:
            result["ready_s"] = round(wait_healthy(url, process, args.deadline_s), 1)
            result["first_request_ttft_ms"] = round(first_token_s(url, served_model(url), "Hello") * 1e3, 1)
            result["first_token_s"] = round(time.monotonic() - start, 1)  # from the process start
            if args.radix_pairs:
                result["radix"] = radix_ttft(url, args.radix_pairs, args.prefix_words)
        finally:
            process.terminate()
            process.wait(timeout=60)
    warmup = [line for line in log_path.read_text(errors="replace").splitlines() if "warm-up:" in line]
    result["warmup_log"] = warmup[-1].split("warm-up:", 1)[1].strip() if warmup else None
    return result


def targets(serving: dict[str, Any]) -> dict[str, Any]:
    """The issue's serving targets, each with its figure and whether it is met (None: not measured)."""
    engines = {e["quant"]: e for e in serving.get("engines", []) if "error" not in e}

    def tps(quant: str, streams: int) -> float | None:
        run = engines.get(quant, {}).get(f"streams_{streams}")
        return run.get("output_tokens_per_s") if run else None

    int4 = engines.get("int4", {}).get("streams_1", {})
    frac = int4.get("hbm_fraction")
    ternary, bf16 = tps("bitnet", 1), tps("none", 1)
    one, many = tps("int4", 1), tps("int4", 64)
    out: dict[str, Any] = {
        "int4_b1_hbm_fraction": {
            "value": frac,
            "target": 0.40,
            "met": None if frac is None else frac >= 0.40,
        },
    }
    ratio = round(ternary / bf16, 2) if ternary and bf16 else None
    out["ternary_over_bf16_b1"] = {
        "value": ratio,
        "target": 3.0,
        "met": None if ratio is None else ratio >= 3,
    }
    scale = round(many / one, 2) if many and one else None
    out["int4_64_over_1_streams"] = {
        "value": scale,
        "target": 10.0,
        "met": None if scale is None else scale >= 10,
    }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("ready", help="time an engine's start to /health and to its first token")
    r.add_argument("--model", required=True)
    r.add_argument("--quant", default="int4", choices=["auto", "int4", "none", "bitnet"])
    r.add_argument("--label", default="cold", help="cold or warm (Triton's cache filled), for the record")
    r.add_argument("--device", default="cuda")
    r.add_argument("--port", type=int, default=8120)
    r.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    r.add_argument("--deadline-s", type=float, default=240)
    r.add_argument("--radix-pairs", type=int, default=0, help="prompt pairs for the hit/miss TTFT (0: none)")
    r.add_argument("--prefix-words", type=int, default=600)
    r.add_argument("--log-dir", default=".")
    t = sub.add_parser("targets", help="issue 50's serving targets from cuda_serving's JSON")
    t.add_argument("serving_json", type=Path)
    args = p.parse_args(argv)
    if args.command == "ready":
        print(json.dumps({"phase": f"ready_{args.quant}_{args.label}", **ready(args)}), flush=True)
    else:
        lines = args.serving_json.read_text().strip().splitlines()
        print(json.dumps({"phase": "targets", **targets(json.loads(lines[-1]))}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
