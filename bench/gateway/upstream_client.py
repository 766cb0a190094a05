"""httpx versus aiohttp for the gateway -> engine hop.

Starts the stand-in engine (`bench.gateway.standin`) in a subprocess (so the client and the
server do not share a GIL), then drives it with each client at a fixed
concurrency through one pooled client, and prints JSON with requests per
second. Two shapes: a unary JSON call and an NDJSON stream like
``/rpc/v1/generate``.

    python -m bench.gateway.upstream_client --concurrency 64 --requests 3000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import httpx

from bench.gateway.standin import start_standin
from protocol.rpc import ABORT_PATH, GENERATE_PATH
from tern_stack.services import free_port

STREAM_LINES = 16
_BODY = json.dumps(
    {"request_id": "bench", "prompt": "hello", "sampling": {"max_tokens": STREAM_LINES}}
).encode()


async def _drive(call: Callable[[], Awaitable[None]], *, concurrency: int, requests: int) -> float:
    """Run ``requests`` calls with ``concurrency`` workers; return requests per second."""
    remaining = requests

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await call()

    for _ in range(min(concurrency, 50)):  # warm up the pool
        await call()
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return requests / (time.perf_counter() - start)


async def bench_httpx(base: str, *, stream: bool, concurrency: int, requests: int) -> float:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as client:

        async def call() -> None:
            if stream:
                async with client.stream("POST", GENERATE_PATH, content=_BODY) as resp:
                    async for _ in resp.aiter_lines():
                        pass
            else:
                resp = await client.post(ABORT_PATH, content=_BODY)
                resp.json()

        return await _drive(call, concurrency=concurrency, requests=requests)


async def bench_aiohttp(base: str, *, stream: bool, concurrency: int, requests: int) -> float:
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(base_url=base, connector=connector) as session:

        async def call() -> None:
            if stream:
                async with session.post(GENERATE_PATH, data=_BODY) as resp:
                    async for _ in resp.content:
                        pass
            else:
                async with session.post(ABORT_PATH, data=_BODY) as resp:
                    await resp.json()

        return await _drive(call, concurrency=concurrency, requests=requests)


async def run(*, concurrency: int, requests: int) -> dict[str, Any]:
    port = free_port()
    proc = start_standin(port)
    base = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {"concurrency": concurrency, "requests": requests, "cpus": os.cpu_count()}
    try:
        for shape in ("unary", "stream"):
            stream = shape == "stream"
            for name, bench in (("httpx", bench_httpx), ("aiohttp", bench_aiohttp)):
                rps = await bench(base, stream=stream, concurrency=concurrency, requests=requests)
                results[f"{name}_{shape}_rps"] = round(rps, 1)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    results["versions"] = {"httpx": httpx.__version__, "aiohttp": aiohttp.__version__}
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(run(concurrency=args.concurrency, requests=args.requests)), indent=2))


if __name__ == "__main__":
    main()
