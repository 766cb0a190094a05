"""A real ``tern gateway`` process SIGKILLed under load and started again, for the crash fault tests.

:class:`GatewayProcess` runs the gateway on a fixed port and spool dir; :class:`Load` runs client
threads (streaming and not, each request's own token count taken from ``logprobs``: one entry per
token) that keep going through the kills, and records what each client saw of each request.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tern_stack.services import PostgresServer, free_port

READY_DEADLINE_S = 60.0


class GatewayProcess:
    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.env = env
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> GatewayProcess:
        command = [
            sys.executable,
            "-m",
            "tern_cli",
            "gateway",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + READY_DEADLINE_S
        while True:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert self.process.poll() is None, self.log()
            assert time.monotonic() < deadline, f"the gateway did not become ready:\n{self.log()}"
            time.sleep(0.1)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        assert self.process.wait(30) == -signal.SIGKILL

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@contextmanager
def postgres_paused(server: PostgresServer) -> Iterator[None]:
    """SIGSTOP every process of the cluster (as a hung database host looks), SIGCONT on exit."""
    postmaster = int((server.data_dir / "postmaster.pid").read_text().split()[0])
    pids = [postmaster]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == postmaster:
            pids.append(int(stat.parent.name))
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


@dataclass
class Attempt:
    """One request as its client saw it."""

    key_name: str
    stream: bool
    max_tokens: int
    status: int | None = None
    request_id: str | None = None
    tokens: int = 0
    """Tokens received (logprobs entries)."""
    completed: bool = False
    """The whole answer arrived: [DONE], or a 200 JSON body."""
    reported_completion_tokens: int | None = None
    error: str | None = None


@dataclass
class Load:
    """Client threads looping requests against whatever gateway ``url`` names, until stopped."""

    url: str
    model: str
    keys: dict[str, str]
    attempts: list[Attempt] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    up: threading.Event = field(default_factory=threading.Event)
    """Set while the gateway is up: a client refused meanwhile waits for it instead of spinning."""
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, clients: int, *, key_name: str) -> None:
        for n in range(clients):
            thread = threading.Thread(target=self._loop, args=(n, key_name), daemon=True)
            thread.start()
            self._threads.append(thread)

    def finish(self) -> list[Attempt]:
        self.stop.set()
        self.up.set()
        for thread in self._threads:
            thread.join(120)
            assert not thread.is_alive(), "a client hung"
        return self.attempts

    def _loop(self, n: int, key_name: str) -> None:
        rng = random.Random(n)
        while not self.stop.is_set():
            attempt = self.one(key_name, stream=n % 2 == 0, max_tokens=rng.randint(3, 12), prompt_no=n)
            if attempt.status is None:  # the gateway is down: wait for it to come back
                self.up.wait(120)

    def one(self, key_name: str, *, stream: bool, max_tokens: int, prompt_no: int = 0) -> Attempt:
        attempt = Attempt(key_name, stream, max_tokens)
        with self._lock:
            self.attempts.append(attempt)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": f"Count from {prompt_no} to 60, one number a line."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": True,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        headers = {"Authorization": f"Bearer {self.keys[key_name]}"}
        try:
            with httpx.Client(base_url=self.url, timeout=60, headers=headers) as http:
                if stream:
                    self._stream(http, body, attempt)
                else:
                    response = http.post("/v1/chat/completions", json=body)
                    attempt.status = response.status_code
                    attempt.request_id = response.headers.get("x-request-id")
                    if response.status_code == 200:
                        answer = response.json()
                        attempt.tokens = len(answer["choices"][0]["logprobs"]["content"])
                        attempt.reported_completion_tokens = answer["usage"]["completion_tokens"]
                        attempt.completed = True
        except httpx.TransportError as exc:  # cut by the kill, or refused while it is down
            attempt.error = repr(exc)
        return attempt

    def _stream(self, http: httpx.Client, body: dict[str, Any], attempt: Attempt) -> None:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            attempt.status = response.status_code
            attempt.request_id = response.headers.get("x-request-id")
            if response.status_code != 200:
                response.read()
                return
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    attempt.completed = True
                    continue
                if not line.startswith("data: "):
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    attempt.error = str(event["error"])
                    continue
                if event.get("usage"):
                    attempt.reported_completion_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or ():
                    attempt.tokens += len((choice.get("logprobs") or {}).get("content") or [])
