"""A streaming load client for any OpenAI-compatible chat server (``tern bench engine-vs-llamacpp``'s).

    python -m bench.engine.openai_load --url http://127.0.0.1:18201 --server tern --concurrency 16 \
        --requests 64 --ignore-eos --stream-usage

Sends ``--requests`` requests, ``--concurrency`` at a time, to ``{url}/v1/chat/completions``: stream,
temperature 0, ``--max-tokens`` each, cycling the prompts of ``peer_prompts.json`` (or ``--prompts``).
Per request: time to the first content chunk, the gaps between content chunks, and the output tokens
(``usage.completion_tokens`` when the server sends usage, else the content chunks). Prints one JSON
line (and appends it to ``--out``). Moved here from the team's peers folder (where it was
``bench_openai_server.py``), unchanged in what it sends and reports, so old and new figures compare.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

PROMPTS = Path(__file__).with_name("peer_prompts.json")


@dataclass(slots=True)
class Sample:
    ttft_s: float | None
    itls_s: list[float]
    e2e_s: float
    out: int
    usage: bool


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100.0
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def request_body(args: argparse.Namespace, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": args.model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "temperature": 0,
        "max_tokens": args.max_tokens,
    }
    if args.stream_usage:
        body["stream_options"] = {"include_usage": True}
    if args.ignore_eos:
        body["ignore_eos"] = True  # llama.cpp server's (and vLLM's) extension; Tern's too
    if args.extra_body:
        body.update(json.loads(args.extra_body))
    return body


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, prompt: str) -> Sample:
    started = time.perf_counter()
    times: list[float] = []
    usage: dict[str, Any] | None = None
    async with client.stream("POST", "/v1/chat/completions", json=request_body(args, prompt)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    times.append(now)
                    break
    out = usage.get("completion_tokens") if usage and usage.get("completion_tokens") else len(times)
    return Sample(
        ttft_s=times[0] - started if times else None,
        itls_s=[b - a for a, b in itertools.pairwise(times)],
        e2e_s=time.perf_counter() - started,
        out=int(out),
        usage=usage is not None,
    )


async def run(args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(
        base_url=args.url, limits=limits, timeout=httpx.Timeout(args.timeout)
    ) as client:
        if args.model is None:
            args.model = (await client.get("/v1/models")).json()["data"][0]["id"]
        for i in range(args.warmup):
            await one_request(client, args, prompts[i % len(prompts)])
        samples: list[Sample] = []
        next_index = 0

        async def worker() -> None:
            nonlocal next_index
            while next_index < args.requests:
                i, next_index = next_index, next_index + 1
                samples.append(await one_request(client, args, prompts[i % len(prompts)]))

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - began
    return summary(args, samples, wall)


def summary(args: argparse.Namespace, samples: list[Sample], wall: float) -> dict[str, Any]:
    ttfts = [s.ttft_s * 1000 for s in samples if s.ttft_s is not None]
    itls = [x * 1000 for s in samples for x in s.itls_s]
    e2e = [s.e2e_s * 1000 for s in samples]
    outs = [s.out for s in samples]

    def rounded(value: float | None, digits: int) -> float | None:
        return None if value is None else round(value, digits)

    record: dict[str, Any] = {
        "server": args.server,
        "concurrency": args.concurrency,
        "requests": len(samples),
        "output_tok_per_s": round(sum(outs) / wall, 2),
        "ttft_p50_ms": rounded(percentile(ttfts, 50), 1),
        "ttft_p99_ms": rounded(percentile(ttfts, 99), 1),
        "itl_p50_ms": rounded(percentile(itls, 50), 2),
        "itl_p99_ms": rounded(percentile(itls, 99), 2),
        "req_per_s": round(len(samples) / wall, 4),
        "output_tokens": sum(outs),
        "out_per_req_min": min(outs),
        "out_per_req_max": max(outs),
        "out_per_req_mean": round(statistics.mean(outs), 1),
        "e2e_p50_ms": rounded(percentile(e2e, 50), 1),
        "e2e_p99_ms": rounded(percentile(e2e, 99), 1),
        "wall_s": round(wall, 3),
        "tokens_from": "usage" if all(s.usage for s in samples) else "content-chunks",
        "max_tokens": args.max_tokens,
        "ignore_eos": bool(args.ignore_eos),
        "model": args.model,
        "date": datetime.date.today().isoformat(),
    }
    if args.note:
        record["note"] = args.note
    if args.tag:
        record["run"] = args.tag
    return record


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:18201")
    p.add_argument("--server", default="unknown", help="label written to the JSON line")
    p.add_argument("--model", default=None, help="model id; default: the first of /v1/models")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts", default=str(PROMPTS), help="a JSON list of prompt strings")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests before the run")
    p.add_argument("--ignore-eos", action="store_true", help='send "ignore_eos": true')
    p.add_argument("--extra-body", default=None, help="JSON merged into the request body")
    p.add_argument("--stream-usage", action="store_true", help="ask for usage in the last chunk")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--note", default=None)
    p.add_argument("--tag", default=None, help="run tag written to the JSON line")
    p.add_argument("--out", type=Path, default=None, help="append the JSON line here too")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    prompts: list[str] = json.loads(Path(args.prompts).read_text())
    emit(asyncio.run(run(args, prompts)), args.out)
    return 0


def emit(record: dict[str, Any], out: Path | None) -> None:
    """Print ``record`` as one JSON line, and append it to ``out`` when given."""
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        with out.open("a") as handle:
            handle.write(line + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
