"""``tern bench gateway``: the gateway's throughput and added latency with auth, limits and metering on.

Starts its own PostgreSQL and Redis (``tern_stack.services``), a stand-in engine that answers at
once, and one gateway process (``tern gateway``, access log on at INFO), each in its own process;
creates a key with rate limits and budgets (so every request runs the admission script, the settle
script and the usage buffer), then measures at each concurrency, from this (third) process with
one keep-alive aiohttp session:

- requests per second through the gateway (non-streaming chat completions);
- latency p50/p99 through the gateway and calling the stand-in directly; the difference is the
  gateway's added latency;
- the gateway process's CPU time per request (Linux ``/proc``): unlike requests per second it hardly
  depends on what else the machine runs, and ``1000 / cpu_ms`` is what one free core could serve.

With ``--budgets``, it also measures what strict budgets cost in one sitting: two keys of the same
tenant with the same rate limits, one with no budget, one with two (tokens per day, spend per month,
priced), driven in turns (``--rounds`` rounds, the order alternating each round, so drift from other
work on the machine falls on both alike); it reports each round's requests/s and CPU time per request
and the ratio of the medians. With ``--callgrind`` as well, the gateway runs under valgrind's callgrind
and each turn also reports the instructions the gateway executed per request: a count that, unlike
CPU time, is the same on a busy machine as on an idle one (the gateway runs some 50 times slower, so
use a few hundred ``--requests``).

Prints one JSON object. ``python -m bench.gateway.gateway --requests 2000 --concurrency 1 64``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from typing import IO, Any, TypeVar

import aiohttp
import httpx

from bench.gateway.standin import MODEL, start_standin
from gateway.db import upgrade_database
from protocol.rpc import GENERATE_PATH
from tern_stack.services import PostgresServer, RedisServer, free_port

T = TypeVar("T")

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
GENERATE = {"request_id": "bench", "model": MODEL, "prompt": "hi", "sampling": {"max_tokens": 1}}


# ---------------------------------------------------------------- measuring


def process_cpu_s(pid: int) -> float | None:
    """User plus system CPU seconds a process has used so far (Linux); None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """uvloop when installed (uvicorn[standard] brings it), so the load generator stays cheap."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def drive(
    url: str, body: dict[str, Any], headers: dict[str, str], *, requests: int, concurrency: int
) -> dict:
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    payload = json.dumps(body).encode()
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        remaining = requests

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                t0 = time.perf_counter()
                async with session.post(url, data=payload, headers={"content-type": "application/json"}) as r:
                    await r.read()
                latencies.append(time.perf_counter() - t0)
                statuses[r.status] = statuses.get(r.status, 0) + 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return {
        "requests": len(latencies),
        "statuses": statuses,
        "rps": round(len(latencies) / elapsed, 1),
        "p50_ms": round(percentile(latencies, 0.50) * 1000, 3),
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 3),
    }


def journal_counts(base: str) -> tuple[float, float]:
    """The gateway's usage journal syncs and the lines they made durable, so far (``/metrics``)."""
    values = {"tern_usage_journal_syncs_total": 0.0, "tern_usage_journal_synced_lines_total": 0.0}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in values:
            values[name] = float(value)
    return values["tern_usage_journal_syncs_total"], values["tern_usage_journal_synced_lines_total"]


def wait_http(url: str, process: subprocess.Popen[bytes], *, deadline_s: float = 60) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up")
        time.sleep(0.1)


class Callgrind:
    """Instructions a process runs under valgrind's callgrind, counted between marks
    (``callgrind_control``: zero the counters, then dump them)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def wrap(self, command: list[str]) -> list[str]:
        return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={self.directory}/cg.%p", *command]

    def zero(self, pid: int) -> None:
        subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)

    def count(self, pid: int) -> int:
        """Instructions since the last ``zero``."""
        before = set(os.listdir(self.directory))
        subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for name in sorted(set(os.listdir(self.directory)) - before):
                with open(os.path.join(self.directory, name)) as dump:
                    lines = dump.read().splitlines()
                if any(line.startswith("totals:") for line in lines):  # written to the end
                    return next(int(line.split()[1]) for line in lines if line.startswith("summary:"))
            time.sleep(0.1)
        raise RuntimeError("callgrind wrote no dump")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def budget_keys(base: str, admin: dict[str, str], tenant_id: str) -> dict[str, dict[str, str]]:
    """Two keys with the same rate limits: ``none`` without budgets, ``two`` with two of them."""
    limits = {"rpm_limit": 1_000_000_000, "tpm_limit": 2_000_000_000, "max_concurrency": 10_000}
    price = {"model": MODEL, "prompt_per_mtok": "0.15", "completion_per_mtok": "0.6"}
    httpx.post(f"{base}/admin/prices", json=price, headers=admin).raise_for_status()
    keys = {}
    for name in ("none", "two"):
        body = {"tenant_id": tenant_id, "name": f"bench-budgets-{name}", "kind": "inference", **limits}
        created = httpx.post(f"{base}/admin/keys", json=body, headers=admin).json()
        keys[name] = {"Authorization": f"Bearer {created['key']}"}
        if name == "two":
            for metric, period, amount in (("tokens", "day", 10**12), ("spend", "month", 10**9)):
                budget = {"tenant_id": tenant_id, "key_id": created["id"], "metric": metric, "period": period}
                response = httpx.post(
                    f"{base}/admin/budgets", json={**budget, "amount": amount}, headers=admin
                )
                response.raise_for_status()
    return keys


def compare_budgets(
    url: str,
    keys: dict[str, dict[str, str]],
    gateway_pid: int,
    *,
    requests: int,
    concurrency: int,
    rounds: int,
    callgrind: Callgrind | None = None,
) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in keys}
    for name in keys:  # warm-up: connections, caches, the budgets' counters seeded
        run_loop(drive(url, CHAT, keys[name], requests=200, concurrency=concurrency))
    for round_index in range(rounds):
        order = list(keys) if round_index % 2 == 0 else list(reversed(keys))
        for name in order:
            if callgrind is not None:
                callgrind.zero(gateway_pid)
            cpu_before = process_cpu_s(gateway_pid)
            result = run_loop(drive(url, CHAT, keys[name], requests=requests, concurrency=concurrency))
            cpu_after = process_cpu_s(gateway_pid)
            if cpu_before is not None and cpu_after is not None:
                result["gateway_cpu_ms_per_request"] = round((cpu_after - cpu_before) * 1000 / requests, 3)
            if callgrind is not None:
                result["gateway_instructions_per_request"] = round(callgrind.count(gateway_pid) / requests)
            runs[name].append(result)
    summary: dict[str, Any] = {"concurrency": concurrency, "rounds": rounds, "runs": runs}
    for name, results in runs.items():
        summary[f"median_rps_{name}"] = _median([r["rps"] for r in results])
        cpu = [r["gateway_cpu_ms_per_request"] for r in results if "gateway_cpu_ms_per_request" in r]
        if cpu:
            summary[f"median_cpu_ms_{name}"] = _median(cpu)
        instructions = [r["gateway_instructions_per_request"] for r in results if callgrind is not None]
        if instructions:
            summary[f"median_instructions_{name}"] = _median(instructions)
    summary["rps_ratio_two_over_none"] = round(summary["median_rps_two"] / summary["median_rps_none"], 4)
    if callgrind is not None:
        summary["instructions_ratio_two_over_none"] = round(
            summary["median_instructions_two"] / summary["median_instructions_none"], 4
        )
    if "median_cpu_ms_two" in summary and "median_cpu_ms_none" in summary:
        summary["cpu_ratio_two_over_none"] = round(
            summary["median_cpu_ms_two"] / summary["median_cpu_ms_none"], 4
        )
    return summary


def _inference_key(base: str, admin: dict[str, str]) -> tuple[str, dict[str, str]]:
    """A tenant and a key with rate limits and a token budget: the tenant's id and the key's header."""
    tenant = httpx.post(f"{base}/admin/tenants", json={"name": "bench"}, headers=admin).json()
    limits = {"rpm_limit": 1_000_000_000, "tpm_limit": 2_000_000_000, "max_concurrency": 10_000}
    body = {"tenant_id": tenant["id"], "name": "bench", "kind": "inference", **limits}
    key = httpx.post(f"{base}/admin/keys", headers=admin, json={**body, "monthly_token_budget": 10**12})
    return tenant["id"], {"Authorization": f"Bearer {key.json()['key']}"}


def _one_concurrency(
    base: str, direct_url: str, auth: dict[str, str], gateway_pid: int, *, requests: int, concurrency: int
) -> dict[str, Any]:
    """The stand-in called directly, then through the gateway (with its CPU time and journal syncs)."""
    chat_url, drive_args = f"{base}/v1/chat/completions", {"requests": requests, "concurrency": concurrency}
    run_loop(drive(chat_url, CHAT, auth, requests=200, concurrency=concurrency))  # warm-up
    direct = run_loop(drive(direct_url, GENERATE, {}, **drive_args))
    syncs_before, lines_before = journal_counts(base)
    cpu_before = process_cpu_s(gateway_pid)
    through = run_loop(drive(chat_url, CHAT, auth, **drive_args))
    cpu_after = process_cpu_s(gateway_pid)
    syncs_after, lines_after = journal_counts(base)
    syncs, lines = syncs_after - syncs_before, lines_after - lines_before
    # How many requests each journal sync served (the sync's CPU is shared by them).
    through["journal_syncs"] = int(syncs)
    through["journal_lines_per_sync"] = round(lines / syncs, 1) if syncs else None
    if cpu_before is not None and cpu_after is not None:
        cpu_ms = (cpu_after - cpu_before) * 1000 / requests
        through["gateway_cpu_ms_per_request"] = round(cpu_ms, 3)
        through["one_free_core_rps"] = round(1000 / cpu_ms) if cpu_ms else None
    return {
        "concurrency": concurrency,
        "direct": direct,
        "gateway": through,
        "added_p50_ms": round(through["p50_ms"] - direct["p50_ms"], 3),
        "added_p99_ms": round(through["p99_ms"] - direct["p99_ms"], 3),
    }


def _start_gateway(
    env: dict[str, str], port: int, log: IO[bytes], counter: Callgrind | None
) -> subprocess.Popen[bytes]:
    """``tern gateway`` with ``env`` added, logging at INFO as deployed (one JSON line per request)."""
    env = {**os.environ, **env, "TERN_SECRET": secrets.token_hex(16), "TERN_LOG_LEVEL": "INFO"}
    command = [sys.executable, "-m", "tern_cli", "gateway", "--port", str(port)]
    if counter is not None:
        command = counter.wrap(command)
    return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)


def run(
    requests: int,
    concurrencies: list[int],
    *,
    budgets: bool = False,
    rounds: int = 3,
    callgrind: bool = False,
) -> dict[str, Any]:
    admin_key = secrets.token_hex(24)
    children: list[subprocess.Popen[bytes]] = []
    load_before = os.getloadavg()
    with (
        PostgresServer() as pg,
        RedisServer() as redis,
        tempfile.TemporaryFile() as gateway_log,
        tempfile.TemporaryDirectory(prefix="tern-callgrind-") as dumps,
    ):
        counter = Callgrind(dumps) if callgrind else None
        pg.create_database("tern")
        upgrade_database(pg.url("tern"))
        standin_port, gateway_port = free_port(), free_port()
        try:
            children.append(start_standin(standin_port))
            env = {
                "TERN_DATABASE_URL": pg.url("tern"),
                "TERN_REDIS_URL": redis.url(),
                "TERN_ADMIN_KEY": admin_key,
                "TERN_ENGINE_URLS": f"http://127.0.0.1:{standin_port}",
            }
            gateway = _start_gateway(env, gateway_port, gateway_log, counter)
            children.append(gateway)
            base = f"http://127.0.0.1:{gateway_port}"
            wait_http(f"{base}/healthz", gateway, deadline_s=60 if counter is None else 900)
            admin = {"Authorization": f"Bearer {admin_key}"}
            tenant_id, auth = _inference_key(base, admin)
            direct_url = f"http://127.0.0.1:{standin_port}{GENERATE_PATH}"
            results = [
                _one_concurrency(base, direct_url, auth, gateway.pid, requests=requests, concurrency=c)
                for c in concurrencies
            ]
            budget_overhead = []
            if budgets:
                keys = budget_keys(base, admin, tenant_id)
                for concurrency in concurrencies:
                    budget_overhead.append(
                        compare_budgets(
                            f"{base}/v1/chat/completions",
                            keys,
                            gateway.pid,
                            requests=requests,
                            concurrency=concurrency,
                            rounds=rounds,
                            callgrind=counter,
                        )
                    )
        except Exception:
            gateway_log.seek(0)
            sys.stderr.write(gateway_log.read()[-4000:].decode(errors="replace"))
            raise
        finally:
            for child in reversed(children):
                child.terminate()
                child.wait(timeout=30 if counter is None else 300)
    out: dict[str, Any] = {
        "benchmark": "gateway",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            # Other work on the machine skews latency and req/s (not much the CPU time per request).
            "load_average_1m": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
        },
        "features": ["auth", "limits (rpm, tpm, concurrency, token budget)", "usage metering"],
        "requests_per_run": requests,
        "results": results,
    }
    if budgets:
        out["budget_overhead"] = budget_overhead
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tern bench gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--budgets", action="store_true", help="also: two budgets on every request vs none")
    parser.add_argument("--rounds", type=int, default=3, help="turns of each key with --budgets")
    parser.add_argument(
        "--callgrind", action="store_true", help="with --budgets: count the gateway's instructions (valgrind)"
    )
    args = parser.parse_args(argv)
    print(
        json.dumps(
            run(
                args.requests,
                args.concurrency,
                budgets=args.budgets,
                rounds=args.rounds,
                callgrind=args.callgrind,
            ),
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
