"""Load test for a running engine: N concurrent streams, one JSON line of results.

    python -m bench.engine.serving --url http://127.0.0.1:8100 --concurrency 16 \
        --num-requests 32 --max-tokens 64
    python -m bench.engine.serving --concurrency 1 --num-requests 3 --max-tokens 1 --prompt-tokens 2048

Requests go to the internal RPC (``/rpc/v1/generate``) with greedy decoding and
``ignore_eos``, so every request produces exactly ``--max-tokens`` tokens and
runs are comparable with ``bench.engine.hf_baseline``. Time to first token is
measured from sending the request to the first frame carrying a token;
inter-token latency is the gap between consecutive tokens of one request.

On a shared machine wall-clock figures follow the neighbours' load, so the result
also carries the 1-minute load average, and with ``--engine-pid`` the CPU seconds
the engine process spent on the run (output tokens per engine CPU second).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.engine import PROMPTS
from bench.engine.long_prompts import long_prompts
from engine.loader import load_tokenizer
from protocol.rpc import GENERATE_PATH, DeltaFrame, FinalFrame, parse_frame


@dataclass
class RequestResult:
    ttft: float
    token_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


async def one_request(
    client: httpx.AsyncClient, url: str, rid: str, prompt: str | list[int], max_tokens: int
) -> RequestResult:
    body = {
        "request_id": rid,
        "prompt": prompt,
        "sampling": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    }
    start = time.perf_counter()
    token_times: list[float] = []
    final: FinalFrame | None = None
    async with client.stream("POST", url + GENERATE_PATH, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line:
                continue
            frame = parse_frame(line)
            if isinstance(frame, DeltaFrame):
                token_times.extend([time.perf_counter()] * len(frame.token_ids))
            elif isinstance(frame, FinalFrame):
                final = frame
            else:
                raise RuntimeError(f"request {rid} failed: {frame.message}")
    if final is None:
        raise RuntimeError(f"request {rid} ended without a final frame")
    return RequestResult(
        token_times[0] - start, token_times, final.completion_tokens, final.prompt_tokens, final.cached_tokens
    )


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a local process so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(
    url: str,
    concurrency: int,
    num_requests: int,
    max_tokens: int,
    engine_pid: int | None = None,
    prompt_tokens: int | None = None,
    tokenizer_path: str | None = None,
) -> dict[str, Any]:
    """``tokenizer_path``: the model whose tokenizer builds the long prompts (None: the default one)."""
    prompts: list[str] | list[list[int]] = PROMPTS
    if prompt_tokens:
        prompts = long_prompts(load_tokenizer(tokenizer_path), prompt_tokens, num_requests)
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        # One warm-up request, so lazy initialisation is not billed to the first measurement.
        await one_request(client, url, "bench-warmup", PROMPTS[0], 4)

        async def limited(i: int) -> RequestResult:
            async with semaphore:
                return await one_request(client, url, f"bench-{i}", prompts[i % len(prompts)], max_tokens)

        load_avg = os.getloadavg()[0]
        cpu_start = process_cpu_seconds(engine_pid) if engine_pid else 0.0
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(i) for i in range(num_requests)))
        elapsed = time.perf_counter() - start
        engine_cpu = process_cpu_seconds(engine_pid) - cpu_start if engine_pid else None
    ttfts = [r.ttft for r in results]
    itls = [b - a for r in results for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    output_tokens = sum(r.completion_tokens for r in results)
    cpu: dict[str, float] = {}
    if engine_cpu is not None:
        cpu = {
            "engine_cpu_s": round(engine_cpu, 3),
            "output_tokens_per_engine_cpu_s": round(output_tokens / engine_cpu, 2),
        }
    return {
        "url": url,
        "concurrency": concurrency,
        "num_requests": num_requests,
        "max_tokens": max_tokens,
        "output_tokens": output_tokens,
        "duration_s": round(elapsed, 3),
        "output_tokens_per_s": round(output_tokens / elapsed, 2),
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_per_s_p50": round(prompt_tokens / percentile(ttfts, 50), 1)
        if prompt_tokens
        else None,
        "ttft_p50_ms": round(percentile(ttfts, 50) * 1000, 1),
        "ttft_p99_ms": round(percentile(ttfts, 99) * 1000, 1),
        "itl_p50_ms": round(percentile(itls, 50) * 1000, 1),
        "itl_p99_ms": round(percentile(itls, 99) * 1000, 1),
        **cpu,
        "load_avg_1m": round(load_avg, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8100")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--engine-pid",
        type=int,
        help="the engine's process id, when it runs on this machine: also report the CPU time it used",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        help="long-prompt prefill case: each request a distinct prompt of this many tokens (bench.engine."
        "long_prompts) instead of the 16 short chat prompts; TTFT is then the prefill time",
    )
    args = p.parse_args(argv)
    result = asyncio.run(
        run(
            args.url.rstrip("/"),
            args.concurrency,
            args.num_requests,
            args.max_tokens,
            args.engine_pid,
            args.prompt_tokens,
        )
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
