"""``tern bench prefix-routing``: cache-aware routing against round-robin, 2 Tern engines, one gateway.

The workload is ``bench/engine/shared_prefix.py``'s (SGLang's ``generated-shared-prefix``): groups of
requests share a long system prompt, each with its own question, as token-id prompts so the shared
part is exact; here the requests of all groups arrive interleaved (shuffled), as traffic from many
applications does. Each engine's KV cache is kept small (``--kv-cache-gib``) so it can hold about
half of the groups' system prompts: what a cache-aware router is for, since routing each group to
one engine fits, while round-robin makes both engines hold (and evict) every group.

For each policy and prefix-cache isolation: fresh PostgreSQL and Redis (once), two fresh ``tern
engine`` processes (one thread each), one ``tern gateway`` with ``TERN_ROUTING_POLICY`` and
``TERN_PREFIX_CACHE_ISOLATION`` set, and the same workload, streamed with
``stream_options.include_usage`` at a fixed concurrency. With ``--tenants N`` the requests take turns
among N tenants' keys, as N applications sharing one system prompt would: under the default
isolation (``tenant``) each tenant caches the prompt once for itself. Reported per run: the
prefix-cache hit rate (``cached_tokens`` over ``prompt_tokens``, as the engines reported in usage)
and TTFT p50/p99 at the client. Prints one JSON object.

    python -m bench.gateway.prefix_routing --num-groups 8 --prompts-per-group 8
    python -m bench.gateway.prefix_routing --policies cache_aware --tenants 4 --isolation tenant shared
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO, Any

import httpx

from bench.gateway.gateway import percentile, wait_http
from gateway.db import upgrade_database
from tern_stack.services import PostgresServer, RedisServer, free_port

POLICIES = ("round_robin", "cache_aware")
ISOLATIONS = ("tenant", "shared")


@dataclass(frozen=True)
class Workload:
    num_groups: int
    prompts_per_group: int
    system_prompt_len: int
    question_len: int
    output_len: int
    seed: int
    token_range: tuple[int, int] = (1000, 20000)

    def prompts(self) -> list[list[int]]:
        """Each group's system prompt plus one question per request, then shuffled."""
        rng = random.Random(self.seed)
        lo, hi = self.token_range
        prompts = []
        for _ in range(self.num_groups):
            system = [rng.randrange(lo, hi) for _ in range(self.system_prompt_len)]
            prompts += [
                system + [rng.randrange(lo, hi) for _ in range(self.question_len)]
                for _ in range(self.prompts_per_group)
            ]
        rng.shuffle(prompts)
        return prompts


@dataclass
class Result:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int
) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] | None = None
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and event.get("choices"):
                ttft = time.perf_counter() - start
            usage = event.get("usage") or usage
    if ttft is None or usage is None:
        raise RuntimeError("a stream ended without tokens or usage")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Result(ttft, usage["prompt_tokens"], cached)


async def drive(base: str, keys: list[str], workload: Workload, concurrency: int) -> dict[str, Any]:
    """The workload, request i sent with ``keys[i % len(keys)]`` (one tenant each)."""
    clients = [
        httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=None)
        for key in keys
    ]
    try:
        model = (await clients[0].get("/v1/models")).json()["data"][0]["id"]
        limit = asyncio.Semaphore(concurrency)

        async def limited(i: int, prompt: list[int]) -> Result:
            async with limit:
                client = clients[i % len(clients)]
                return await one_request(client, "/v1/completions", model, prompt, workload.output_len)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(i, p) for i, p in enumerate(workload.prompts())))
        duration = time.perf_counter() - start
    finally:
        for client in clients:
            await client.aclose()
    prompt_tokens = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    ttfts = [r.ttft_s for r in results]
    return {
        "requests": len(results),
        "duration_s": round(duration, 2),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "cache_hit_rate": round(cached / prompt_tokens, 4),
        "ttft_p50_ms": round(percentile(ttfts, 0.50) * 1000, 1),
        "ttft_p99_ms": round(percentile(ttfts, 0.99) * 1000, 1),
    }


def start_engines(
    args: argparse.Namespace, log: IO[bytes]
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    processes, urls = [], []
    for _ in range(2):
        port = free_port()
        command = [sys.executable, "-m", "tern_cli", "engine", "--port", str(port), "--num-threads", "1"]
        command += ["--max-num-seqs", str(args.max_num_seqs), "--kv-cache-gib", str(args.kv_cache_gib)]
        command += ["--log-level", "warning"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
    for process, url in zip(processes, urls, strict=True):
        wait_http(f"{url}/health", process, deadline_s=300)
    return processes, urls


def run(args: argparse.Namespace) -> dict[str, Any]:
    admin_key = secrets.token_hex(24)
    secret = secrets.token_hex(16)
    workload = Workload(
        num_groups=args.num_groups,
        prompts_per_group=args.prompts_per_group,
        system_prompt_len=args.system_prompt_len,
        question_len=args.question_len,
        output_len=args.output_len,
        seed=args.seed,
    )
    results: dict[str, Any] = {}
    with PostgresServer() as pg, RedisServer() as redis, tempfile.TemporaryFile() as log:
        pg.create_database("tern")
        upgrade_database(pg.url("tern"))
        keys: list[str] = []
        for policy, isolation in [(p, i) for p in args.policies for i in args.isolation]:
            children: list[subprocess.Popen[bytes]] = []
            try:
                engines, urls = start_engines(args, log)
                children += engines
                port = free_port()
                env = {
                    **os.environ,
                    "TERN_DATABASE_URL": pg.url("tern"),
                    "TERN_REDIS_URL": redis.url(),
                    "TERN_SECRET": secret,
                    "TERN_ADMIN_KEY": admin_key,
                    "TERN_ENGINE_URLS": ",".join(urls),
                    "TERN_ROUTING_POLICY": policy,
                    "TERN_PREFIX_CACHE_ISOLATION": isolation,
                    "TERN_LOG_LEVEL": "WARNING",
                }
                command = [sys.executable, "-m", "tern_cli", "gateway", "--port", str(port)]
                gateway = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
                children.append(gateway)
                base = f"http://127.0.0.1:{port}"
                wait_http(f"{base}/readyz", gateway)
                keys = keys or [create_key(base, admin_key, f"bench-{i}") for i in range(args.tenants)]
                results[f"{policy}/{isolation}"] = asyncio.run(drive(base, keys, workload, args.concurrency))
            except Exception:
                log.seek(0)
                sys.stderr.write(log.read()[-4000:].decode(errors="replace"))
                raise
            finally:
                for child in reversed(children):
                    child.terminate()
                    child.wait(timeout=30)
    return {
        "benchmark": "prefix-routing",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_1m": os.getloadavg()[0],
        },
        "engines": {
            "count": 2,
            "num_threads": 1,
            "max_num_seqs": args.max_num_seqs,
            "kv_cache_gib": args.kv_cache_gib,
        },
        "workload": {
            **vars(workload),
            "order": "shuffled",
            "concurrency": args.concurrency,
            "tenants": args.tenants,
        },
        "results": results,
        "cache_aware_vs_round_robin": compare_policies(results, args.isolation),
    }


def compare_policies(results: dict[str, Any], isolations: list[str]) -> dict[str, Any]:
    """Per isolation mode, cache-aware routing's hit rate and TTFT p50 over round robin's."""
    summary: dict[str, Any] = {}
    for isolation in isolations:
        rr, ca = results.get(f"round_robin/{isolation}"), results.get(f"cache_aware/{isolation}")
        if rr is None or ca is None:
            continue
        summary[isolation] = {
            "hit_rate_ratio": round(ca["cache_hit_rate"] / rr["cache_hit_rate"], 2)
            if rr["cache_hit_rate"]
            else None,
            "ttft_p50_ratio": round(ca["ttft_p50_ms"] / rr["ttft_p50_ms"], 3),
        }
    return summary


def create_key(base: str, admin_key: str, tenant_name: str) -> str:
    admin = {"Authorization": f"Bearer {admin_key}"}
    tenant = httpx.post(f"{base}/admin/tenants", json={"name": tenant_name}, headers=admin).json()
    body = {"tenant_id": tenant["id"], "name": "bench", "kind": "inference"}
    return str(httpx.post(f"{base}/admin/keys", headers=admin, json=body).json()["key"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tern bench prefix-routing", description=__doc__.splitlines()[0])
    p.add_argument(
        "--policies",
        nargs="+",
        choices=["round_robin", "least_loaded", "cache_aware"],
        default=list(POLICIES),
    )
    p.add_argument(
        "--isolation",
        nargs="+",
        choices=ISOLATIONS,
        default=["tenant"],
        help="TERN_PREFIX_CACHE_ISOLATION per run (default: tenant, the gateway's default)",
    )
    p.add_argument("--tenants", type=int, default=1, help="requests take turns among this many tenants")
    p.add_argument("--num-groups", type=int, default=8)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--system-prompt-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument(
        "--kv-cache-gib", type=float, default=0.1, help="per engine: about half the groups' prompts"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(json.dumps(run(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
