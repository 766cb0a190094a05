"""The gateway's cost, two (or more) source trees side by side in one sitting: ``tern bench gateway``'s
load, each tree's gateway at once against the same PostgreSQL, Redis and stand-in engine.

Each tree gets its own database (migrated by that tree's own code) and Redis database, a tenant and
a key with the same limits as ``tern bench gateway``; the gateways are then driven in turns at one
concurrency (the order reversed every round, so drift from other work on the machine falls on all
alike). Reports each run's gateway CPU ms per request (Linux ``/proc``), requests/s and journal
lines per sync, the medians, and for each tree the median of its per-round ratios to the first.

    tern bench gateway-ab --rounds 10 --requests 3000 \\
        parent=/work/wt/parent main=. main-nofsync=.,TERN_USAGE_JOURNAL_FSYNC=false

A tree is ``label=path[,NAME=value...]`` (environment for that gateway only). A tree whose gateway
has no usage journal reports no lines per sync.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.gateway.gateway import CHAT, drive, journal_counts, process_cpu_s, run_loop, wait_http
from bench.gateway.standin import start_standin
from tern_stack.services import PostgresServer, RedisServer, free_port

KEY_LIMITS = {
    "rpm_limit": 1_000_000_000,
    "tpm_limit": 2_000_000_000,
    "max_concurrency": 10_000,
    "monthly_token_budget": 10**12,
}


@dataclass
class Tree:
    label: str
    path: Path
    env: dict[str, str]
    runs: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def parse(cls, spec: str) -> Tree:
        label, _, rest = spec.partition("=")
        path, *env = rest.split(",")
        return cls(label, Path(path).resolve(), dict(item.split("=", 1) for item in env))


def start_gateway(
    tree: Tree, index: int, pg: PostgresServer, redis: RedisServer, engine_url: str, spool: Path
) -> tuple[subprocess.Popen[bytes], str, dict[str, str]]:
    """The tree's gateway on its own database, migrated by its own code; returns (process, base url, auth)."""
    database = f"tern_ab_{index}"
    pg.create_database(database)
    tree_env = {**os.environ, "PYTHONPATH": str(tree.path)}
    migrate = f"from gateway.db import upgrade_database; upgrade_database({pg.url(database)!r})"
    subprocess.run([sys.executable, "-c", migrate], env=tree_env, cwd=tree.path, check=True)
    port, admin_key = free_port(), secrets.token_hex(24)
    env = {
        **tree_env,
        "TERN_DATABASE_URL": pg.url(database),
        "TERN_REDIS_URL": redis.url(index + 1),
        "TERN_SECRET": secrets.token_hex(16),
        "TERN_ADMIN_KEY": admin_key,
        "TERN_ENGINE_URLS": engine_url,
        "TERN_LOG_LEVEL": "INFO",  # as deployed: one JSON access log line per request
        "TERN_USAGE_SPOOL_DIR": str(spool / tree.label),
        **tree.env,
    }
    command = [sys.executable, "-m", "tern_cli", "gateway", "--port", str(port)]
    process = subprocess.Popen(
        command,
        env=env,
        cwd=tree.path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/healthz", process)
    admin = {"Authorization": f"Bearer {admin_key}"}
    tenant = httpx.post(f"{base}/admin/tenants", json={"name": "bench"}, headers=admin).json()
    body = {"tenant_id": tenant["id"], "name": "bench", "kind": "inference", **KEY_LIMITS}
    key = httpx.post(f"{base}/admin/keys", headers=admin, json=body).json()["key"]
    return process, base, {"Authorization": f"Bearer {key}"}


def measure(base: str, auth: dict[str, str], pid: int, *, requests: int, concurrency: int) -> dict[str, Any]:
    syncs_before, lines_before = journal_counts(base)
    cpu_before = process_cpu_s(pid)
    result = run_loop(
        drive(f"{base}/v1/chat/completions", CHAT, auth, requests=requests, concurrency=concurrency)
    )
    cpu_after = process_cpu_s(pid)
    if cpu_before is None or cpu_after is None:
        raise RuntimeError("a process's CPU time is read from Linux's /proc")
    syncs_after, lines_after = journal_counts(base)
    syncs, lines = syncs_after - syncs_before, lines_after - lines_before
    return {
        "rps": result["rps"],
        "cpu_ms_per_request": round((cpu_after - cpu_before) * 1000 / requests, 4),
        "journal_lines_per_sync": round(lines / syncs, 1) if syncs else None,
        "statuses": result["statuses"],
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def run(trees: list[Tree], *, rounds: int, requests: int, concurrency: int) -> dict[str, Any]:
    processes: list[subprocess.Popen[bytes]] = []
    with PostgresServer() as pg, RedisServer() as redis, tempfile.TemporaryDirectory() as spool:
        try:
            engine_port = free_port()
            processes.append(start_standin(engine_port))
            gateways = []
            for index, tree in enumerate(trees):
                process, base, auth = start_gateway(
                    tree, index, pg, redis, f"http://127.0.0.1:{engine_port}", Path(spool)
                )
                processes.append(process)
                run_loop(
                    drive(f"{base}/v1/chat/completions", CHAT, auth, requests=500, concurrency=concurrency)
                )
                gateways.append((tree, base, auth, process.pid))
            for round_index in range(rounds):
                for tree, base, auth, pid in gateways if round_index % 2 == 0 else reversed(gateways):
                    run_result = measure(base, auth, pid, requests=requests, concurrency=concurrency)
                    tree.runs.append(run_result)
                    print(
                        json.dumps({"round": round_index, "tree": tree.label, **run_result}), file=sys.stderr
                    )
        finally:
            for process in reversed(processes):
                process.terminate()
                process.wait(timeout=30)
    first = trees[0]
    summary: dict[str, Any] = {}
    for tree in trees:
        cpu = [r["cpu_ms_per_request"] for r in tree.runs]
        summary[tree.label] = {
            "path": str(tree.path),
            "env": tree.env,
            "median_cpu_ms_per_request": statistics.median(cpu),
            "median_rps": statistics.median(r["rps"] for r in tree.runs),
            f"median_round_cpu_ratio_to_{first.label}": round(
                statistics.median(
                    run["cpu_ms_per_request"] / ref["cpu_ms_per_request"]
                    for run, ref in zip(tree.runs, first.runs, strict=True)
                ),
                4,
            ),
            "runs": tree.runs,
        }
    return {
        "benchmark": "gateway_ab",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "requests_per_run": requests,
        "concurrency": concurrency,
        "rounds": rounds,
        "trees": summary,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tern bench gateway-ab", description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", help="label=path[,NAME=value...]; the first is the reference")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args(argv)
    trees = [Tree.parse(spec) for spec in args.trees]
    print(
        json.dumps(
            run(trees, rounds=args.rounds, requests=args.requests, concurrency=args.concurrency), indent=2
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
