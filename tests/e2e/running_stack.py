"""One ``tern up`` as a user runs it, for the end-to-end tests: start it, read what it wrote, stop it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tern_stack.services import free_port

READY_DEADLINE_S = 600.0
STOP_DEADLINE_S = 90.0


def sessions_alive(session_ids: set[int]) -> list[str]:
    """Processes (``pid comm``) whose process group or session is one of ``session_ids``."""
    alive = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid_and_comm, rest = stat_file.read_text().rsplit(") ", 1)
        except OSError:
            continue
        state, _ppid, pgrp, session = rest.split()[:4]
        if state != "Z" and (int(pgrp) in session_ids or int(session) in session_ids):
            alive.append(pid_and_comm.replace(" (", " "))
    return alive


@dataclass
class RunningStack:
    """One ``tern up`` process and what it wrote to its data dir."""

    process: subprocess.Popen[bytes]
    data_dir: Path
    log_path: Path
    info: dict[str, Any]

    @property
    def url(self) -> str:
        return str(self.info["gateway_url"])

    @property
    def admin_key(self) -> str:
        return (self.data_dir / "admin_key").read_text().strip()

    @property
    def demo_key(self) -> str:
        return (self.data_dir / "demo_key").read_text().strip()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> int:
        """SIGTERM, as a service manager would send; the exit code."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=STOP_DEADLINE_S)


def start_stack(
    data_dir: Path, *, extra_env: dict[str, str] | None = None, args: tuple[str, ...] = ()
) -> RunningStack:
    """``tern up`` as ``make up`` runs it, in its own session, ready once ``run.json`` appears."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("TERN_") and name not in ("DATABASE_URL", "REDIS_URL")
    }
    env.update({"TERN_GATEWAY_PORT": str(free_port()), **(extra_env or {})})
    log_path = data_dir.parent / f"tern-up-{time.monotonic_ns()}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tern_cli", "up", "--data-dir", str(data_dir), *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    run_file = data_dir / "run.json"
    deadline = time.monotonic() + READY_DEADLINE_S
    while not run_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None:
                process.kill()
                process.wait()
            pytest.fail(f"tern up did not become ready:\n{log_path.read_text(errors='replace')[-4000:]}")
        time.sleep(0.2)
    return RunningStack(process, data_dir, log_path, json.loads(run_file.read_text()))


# -- what the tests do through the stack, as an operator and an application would --------------------

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def new_tenant_and_key(admin: httpx.Client, prefix: str) -> dict[str, Any]:
    """A tenant and an inference key made through the admin API, as an operator would."""
    tenant = admin.post("/admin/tenants", json={"name": f"{prefix}-{uuid.uuid4().hex[:8]}"})
    assert tenant.status_code == 201, tenant.text
    key = admin.post(
        "/admin/keys", json={"tenant_id": tenant.json()["id"], "name": "e2e app", "kind": "inference"}
    )
    assert key.status_code == 201, key.text
    return {"tenant": tenant.json(), **key.json()}


def client_for(stack: RunningStack, key: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key["key"], max_retries=0)


def wait_for_usage_rows(admin: httpx.Client, tenant_id: str, *, requests: int) -> list[dict[str, Any]]:
    """The tenant's usage by key once ``requests`` requests show (usage is flushed in the background)."""
    today = datetime.now(UTC).date()
    query = {
        "tenant": tenant_id,
        "from": (today - timedelta(days=1)).isoformat(),
        "to": (today + timedelta(days=1)).isoformat(),
        "group_by": "key",
    }
    deadline = time.monotonic() + 30
    while True:
        report = admin.get("/admin/reports/usage", params=query)
        assert report.status_code == 200, report.text
        if report.json()["totals"]["requests"] >= requests or time.monotonic() > deadline:
            return report.json()["rows"]
        time.sleep(0.2)
