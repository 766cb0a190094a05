"""``tern status``: what the ``tern up`` (``make up``) stack runs, where, whether it is healthy, and
where its keys and logs are.

It reads the data dir's ``run.json`` and asks the gateway's ``/readyz`` and each engine's ``/health``;
exit status 0 only when a stack runs there and the gateway is ready, so scripts can wait on it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import httpx

from gateway.config import parse_engine_url
from tern_cli.local_stack import LocalStack

KEY_FILES = {"admin key": "admin_key", "demo tenant's key": "demo_key", "TERN_SECRET": "secret"}
PROBE_TIMEOUT_S = 3.0


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie still answers kill(0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return True


def probe(url: str) -> dict[str, Any]:
    """``{"status": HTTP status or None, "detail": ...}`` for one GET."""
    try:
        response = httpx.get(url, timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return {"url": url, "status": None, "detail": f"not answering ({type(exc).__name__})"}
    try:
        detail: Any = response.json()
    except ValueError:
        detail = response.text[:200]
    return {"url": url, "status": response.status_code, "detail": detail}


def collect(stack: LocalStack) -> dict[str, Any]:
    """Everything ``tern status`` shows, as JSON-ready data."""
    info = stack.run_info()
    files = {
        label: str(stack.file_path(name).resolve())
        for label, name in KEY_FILES.items()
        if stack.file_path(name).exists()
    }
    status: dict[str, Any] = {
        "data_dir": str(stack.data_dir.resolve()),
        "running": info is not None,
        "key_files": files,
        "logs": str(stack.file_path("logs").resolve()),
    }
    if info is None:
        return status
    status.update(
        gateway_url=info.gateway_url,
        engine_urls=info.engine_urls,
        postgres_dsn=info.postgres_dsn,
        redis_url=info.redis_url,
        ready_after_s=info.ready_after_s,
        processes={name: {"pid": pid, "alive": process_alive(pid)} for name, pid in info.pids.items()},
        gateway=probe(f"{info.gateway_url}/readyz"),
        engines=[probe(f"{parse_engine_url(url).url}/health") for url in info.engine_urls],
    )
    status["ready"] = status["gateway"]["status"] == 200
    return status


def _health(result: dict[str, Any]) -> str:
    if result["status"] is None:
        return str(result["detail"])
    detail = result["detail"]
    if isinstance(detail, dict) and isinstance(detail.get("checks"), dict):
        checks = ", ".join(f"{name} {'ok' if ok else 'DOWN'}" for name, ok in detail["checks"].items())
        return f"{'ready' if result['status'] == 200 else 'NOT READY'} ({checks})"
    return "ok" if result["status"] == 200 else f"HTTP {result['status']}"


def render(status: dict[str, Any]) -> str:
    lines = [f"Data dir: {status['data_dir']}"]
    if not status["running"]:
        lines.append("Not running: no run.json here. Start the stack with `make up` (or `tern up`).")
    else:
        state = "ready" if status["ready"] else "NOT READY"
        lines.append(f"Stack: {state} (it took {status['ready_after_s']} s to start)")
        processes = status["processes"]

        def pid(name: str) -> str:
            process = processes.get(name)
            if process is None:
                return "not started by tern up"
            return f"pid {process['pid']}{'' if process['alive'] else ' (GONE)'}"

        lines.append(f"  gateway   {status['gateway_url']}  {pid('gateway')}  {_health(status['gateway'])}")
        for url, engine in zip(status["engine_urls"], status["engines"], strict=True):
            lines.append(f"  engine    {url}  {pid('engine')}  {_health(engine)}")
        lines.append(f"  postgres  {status['postgres_dsn']}  {pid('postgres')}")
        lines.append(f"  redis     {status['redis_url']}  {pid('redis')}")
        lines.append(f"  watchdog  {pid('watchdog')}")
    if status["key_files"]:
        lines.append("Keys (files, mode 0600):")
        lines += [f"  {label + ':':19s}{path}" for label, path in status["key_files"].items()]
    lines.append(f"Logs: {status['logs']}/")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    status = collect(LocalStack.find(args.data_dir))
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0 if status.get("ready") else 1


def add_parser(commands: Any) -> None:
    status = commands.add_parser("status", help="what `make up` runs, where, its health, its key files")
    status.add_argument("--data-dir", type=Path, metavar="DIR", help="the stack's data dir (default: .tern)")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(run=cmd_status)
