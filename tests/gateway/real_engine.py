"""``tern engine`` with the default model (SmolLM2-135M GGUF) as a subprocess, for end-to-end tests.

Kept small for a 2-core machine: one torch thread, a few sequences. ``kill()`` and ``start()``
again on the same port make a dead engine that comes back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tern_stack.services import free_port

READY_DEADLINE_S = 300.0


class RealEngine:
    def __init__(self, log_dir: Path, *, extra_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.log_path = log_dir / f"engine-{self.port}.log"
        self.extra_args = extra_args
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RealEngine:
        return self.launch().wait_ready()

    def launch(self) -> RealEngine:
        """Start the process without waiting (start several, then wait for each)."""
        command = [sys.executable, "-m", "tern_cli", "engine", "--port", str(self.port)]
        command += ["--num-threads", "1", "--max-num-seqs", "4", "--log-level", "warning", *self.extra_args]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def wait_ready(self) -> RealEngine:
        assert self.process is not None
        deadline = time.monotonic() + READY_DEADLINE_S
        while True:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"tern engine did not start:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        """SIGKILL: the engine dies as a crashed one does, its port refusing connections."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
