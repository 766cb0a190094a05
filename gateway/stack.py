"""``tern up``: the whole stack on one machine, from a fresh clone, with one command.

In order: PostgreSQL and Redis (embedded, data under ``.tern/``; skipped when ``DATABASE_URL`` /
``REDIS_URL`` point elsewhere), the migrations, one engine (skipped when ``TERN_ENGINE_URLS`` names
engines already running), one gateway. Once ``/readyz`` answers 200 it makes sure a demo tenant and
inference key exist and prints how to call the API. Ctrl-C or SIGTERM stops everything in reverse
order.

Every child gets its own session (process group), so a terminal's Ctrl-C reaches only this process,
which then stops the children in order. A small watchdog process holds a pipe to us; if we die
without cleaning up (SIGKILL, OOM killer), the pipe closes and the watchdog stops the children.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from gateway.keys.format import generate_key
from gateway.local_services import PostgresServer, RedisServer, ServiceError, free_port

DEFAULT_GATEWAY_PORT = 8000
DEFAULT_ENGINE_PORT = 8100
DATABASE_NAME = "tern"
DEMO_TENANT = "demo"
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 20.0


class StackError(RuntimeError):
    """The stack could not start; the message says why and where the logs are."""


class StopRequested(Exception):
    """SIGINT or SIGTERM arrived."""


# ---------------------------------------------------------------- state under .tern/


@dataclass(frozen=True)
class StateDir:
    """Everything ``tern up`` keeps between runs: server data, secrets, logs."""

    root: Path

    def prepare(self) -> None:
        # o+x so PostgreSQL's unprivileged account can reach its data dir below; not listable.
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o711)
        self.logs.mkdir(exist_ok=True)
        self.run_file.unlink(missing_ok=True)  # left behind if the last run was killed

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def run_file(self) -> Path:
        """Where the running stack's URLs and process ids are written (read by tests and tools)."""
        return self.root / "run.json"

    def secret(self, name: str, generate: Callable[[], str]) -> str:
        """The value stored in ``name`` (mode 0600), generated and stored on first use."""
        path = self.root / name
        if path.exists():
            return path.read_text().strip()
        value = generate()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(value + "\n")
        return value

    def forget(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)


# ---------------------------------------------------------------- child processes


def _tern_command() -> list[str]:
    """How to run another ``tern`` subcommand with this same interpreter and install."""
    return [sys.executable, "-m", "gateway.cli"]


@dataclass
class Child:
    """A ``tern`` subcommand running in its own process group, output to a log file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> Child:
        with self.log_path.open("ab") as log:
            log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.argv)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def exited(self) -> int | None:
        """The exit code, or None while it runs."""
        return None if self.process is None else self.process.poll()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to the whole group, then SIGKILL to whatever is left after the grace period."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"  {self.name} did not stop within {timeout_s:.0f} s; killing it", flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)  # stragglers in the group (workers), if any
        self.process.wait()

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class Watchdog:
    """Stops the children if this process dies without doing so itself.

    It runs in its own session and reads lines ``SIGNAL PID`` (negative PID: a process group) from a
    pipe. ``done`` means a clean shutdown happened; end of file without it means we died, and it
    delivers every registered signal in reverse order, then SIGKILLs the groups still alive.
    """

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", "from gateway.stack import run_watchdog; run_watchdog()"],
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        assert self._process.stdin is not None
        self._pipe: IO[bytes] = self._process.stdin

    @property
    def pid(self) -> int:
        return self._process.pid

    def watch(self, sig: signal.Signals, pid: int) -> None:
        self._pipe.write(f"{sig.name} {pid}\n".encode())
        self._pipe.flush()

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):
            self._pipe.write(b"done\n")
            self._pipe.close()
        self._process.wait(timeout=10)


def run_watchdog() -> None:
    """The watchdog's main loop (see :class:`Watchdog`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    targets: list[tuple[signal.Signals, int]] = []
    for line in sys.stdin:
        if line.strip() == "done":
            return
        name, pid = line.split()
        targets.append((signal.Signals[f"SIG{name.removeprefix('SIG')}"], int(pid)))
    for sig, pid in reversed(targets):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    time.sleep(STOP_TIMEOUT_S / 2)
    for _, pid in targets:
        if pid < 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(-pid, signal.SIGKILL)


# ---------------------------------------------------------------- the steps


def _port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _create_database(server: PostgresServer, name: str) -> None:
    """``CREATE DATABASE`` unless it exists (the embedded cluster starts with only ``postgres``)."""
    import asyncio

    import asyncpg

    async def create() -> None:
        conn = await asyncpg.connect(server.url("postgres", driver=""))
        try:
            if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
                await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    asyncio.run(create())


def _postmaster_pid(server: PostgresServer) -> int:
    return int((server.data_dir / "postmaster.pid").read_text().split()[0])


def _libpq_dsn(database_url: str) -> str:
    """The SQLAlchemy URL as psql and pg_dump take it."""
    scheme, rest = database_url.split("://", 1)
    return f"{scheme.split('+')[0]}://{rest}"


def _redis_pid(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return int(client.info("server")["process_id"])
    finally:
        client.close()


def _wait_ready(url: str, stack: Stack, timeout_s: float) -> None:
    """Poll ``/readyz`` until 200, failing fast if a child exits."""
    deadline = time.monotonic() + timeout_s
    last_note = ""
    with httpx.Client(timeout=2.0) as client:
        while True:
            stack.check_children()
            try:
                response = client.get(f"{url}/readyz")
                if response.status_code == 200:
                    return
                note = f"/readyz {response.status_code} {response.text[:200]}"
            except httpx.HTTPError:
                note = "the gateway is not listening yet"
            if note != last_note:
                print(f"  waiting: {note}", flush=True)
                last_note = note
            if time.monotonic() > deadline:
                raise StackError(f"{url}/readyz was not 200 after {timeout_s:.0f} s (last: {note})")
            time.sleep(0.5)


def _ensure_demo_key(url: str, admin_key: str, state: StateDir) -> str:
    """The demo tenant's inference key: the stored one if the gateway still accepts it, else a new one."""
    stored = state.root / "demo_key"
    with httpx.Client(base_url=url, timeout=30.0) as client:
        if stored.exists():
            key = stored.read_text().strip()
            if client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200:
                return key
            state.forget("demo_key")  # the data was reset or the key revoked: make a new one
        admin = {"Authorization": f"Bearer {admin_key}"}
        tenant = _find_tenant(client, admin, DEMO_TENANT)
        if tenant is None:
            response = client.post("/admin/tenants", json={"name": DEMO_TENANT}, headers=admin)
            response.raise_for_status()
            tenant = response.json()
        response = client.post(
            "/admin/keys",
            json={"tenant_id": tenant["id"], "name": "tern up demo", "kind": "inference"},
            headers=admin,
        )
        response.raise_for_status()
        return state.secret("demo_key", lambda: response.json()["key"])


def _find_tenant(client: httpx.Client, admin: dict[str, str], name: str) -> dict[str, Any] | None:
    response = client.get("/admin/tenants", params={"limit": 1000}, headers=admin)
    response.raise_for_status()
    return next((tenant for tenant in response.json()["data"] if tenant["name"] == name), None)


def _model_id(url: str, key: str) -> str:
    response = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10.0)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def _banner(*, url: str, admin_key: str, demo_key: str, model: str, state: StateDir) -> str:
    return f"""
Tern is ready at {url}   (logs: {state.logs}/, data: {state.root}/; Ctrl-C stops everything)

  web console:       {url}/ui/   (sign in with the admin key)
  admin key:         {admin_key}
  demo tenant's key: {demo_key}
  model:             {model}

curl:
  curl {url}/v1/chat/completions \\
    -H "Authorization: Bearer {demo_key}" \\
    -H "Content-Type: application/json" \\
    -d '{{"model": "{model}", "max_tokens": 64, "temperature": 0,
         "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

Python (pip install openai):
  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="{demo_key}")
  reply = client.chat.completions.create(
      model="{model}",
      messages=[{{"role": "user", "content": "What is the capital of France?"}}],
      max_tokens=64,
      temperature=0,
  )
  print(reply.choices[0].message.content)
"""


# ---------------------------------------------------------------- orchestration


class StopSignals:
    """SIGINT and SIGTERM raise :class:`StopRequested`, except inside :meth:`deferred` sections.

    A process started inside a deferred section is always registered for cleanup before the stop
    request is raised, so an early Ctrl-C cannot leave a server running. Once the ``with`` block
    ends (cleanup time), both signals are ignored.
    """

    def __init__(self) -> None:
        self._depth = 0
        self._pending: str | None = None

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self._depth:
            self._pending = name
            return
        raise StopRequested(name)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        except Exception:
            if self._pending:  # a terminal's Ctrl-C also reaches the tools we ran (initdb, pg_ctl)
                raise StopRequested(self._pending) from None
            raise
        finally:
            self._depth -= 1
        if not self._depth and self._pending:
            raise StopRequested(self._pending)

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


@dataclass
class UpOptions:
    model: str | None
    device: str | None
    host: str
    port: int
    data_dir: Path
    ready_timeout_s: float


class Stack:
    """The running pieces; each ``start_*`` registers its own stop on the exit stack (reverse order)."""

    def __init__(
        self, options: UpOptions, state: StateDir, cleanup: contextlib.ExitStack, signals: StopSignals
    ) -> None:
        self.options = options
        self.state = state
        self.cleanup = cleanup
        self.signals = signals
        self.env = dict(os.environ)
        self.env.setdefault("TERN_USAGE_SPOOL_DIR", str(state.root / "spool" / "usage"))
        self.children: list[Child] = []
        self.pids: dict[str, int] = {}
        with signals.deferred():
            self.watchdog = Watchdog()
            cleanup.callback(self.watchdog.close)
        self.pids["watchdog"] = self.watchdog.pid

    def load_secrets(self) -> str:
        """TERN_SECRET and the bootstrap admin key: from the environment, else kept under .tern/."""
        self.env["TERN_SECRET"] = self.env.get("TERN_SECRET") or self.state.secret(
            "secret", lambda: secrets.token_urlsafe(32)
        )
        admin_key = self.env.get("TERN_ADMIN_KEY") or self.state.secret(
            "admin_key", lambda: generate_key("admin")
        )
        self.env["TERN_ADMIN_KEY"] = admin_key
        return admin_key

    def start_postgres(self) -> None:
        database_url = self.env.get("TERN_DATABASE_URL") or self.env.get("DATABASE_URL")
        if database_url:
            print(f"PostgreSQL: using {database_url.split('@')[-1]} (DATABASE_URL)", flush=True)
        else:
            postgres = PostgresServer(data_dir=self.state.root / "postgres", fast=False)
            with self.signals.deferred():
                postgres.start()
                self.cleanup.callback(_announce_and_call, "stopping PostgreSQL", postgres.stop)
                self.pids["postgres"] = _postmaster_pid(postgres)
                self.watchdog.watch(signal.SIGINT, self.pids["postgres"])  # SIGINT: fast shutdown
            _create_database(postgres, DATABASE_NAME)
            database_url = postgres.url(DATABASE_NAME)
            print(f"PostgreSQL: started on port {postgres.port}, data in {postgres.data_dir}", flush=True)
        self.env["TERN_DATABASE_URL"] = database_url

    def start_redis(self) -> None:
        redis_url = self.env.get("TERN_REDIS_URL") or self.env.get("REDIS_URL")
        if redis_url:
            print(f"Redis: using {redis_url.split('@')[-1]} (REDIS_URL)", flush=True)
        else:
            server = RedisServer(data_dir=self.state.root / "redis")
            with self.signals.deferred():
                server.start()
                self.cleanup.callback(_announce_and_call, "stopping Redis", server.stop)
                redis_url = server.url()
                self.pids["redis"] = _redis_pid(redis_url)
                self.watchdog.watch(signal.SIGTERM, -self.pids["redis"])  # its own session
            print(f"Redis: started on port {server.port}, data in {server.data_dir}", flush=True)
        self.env["TERN_REDIS_URL"] = redis_url

    def migrate(self) -> None:
        from gateway.db import upgrade_database  # alembic and SQLAlchemy load only now

        upgrade_database(self.env["TERN_DATABASE_URL"])
        print("Migrations: the database is at the latest revision", flush=True)

    def start_engine(self) -> None:
        engine_urls = self.env.get("TERN_ENGINE_URLS", "").strip()
        if engine_urls:
            print(f"Engine: using {engine_urls} (TERN_ENGINE_URLS)", flush=True)
            return
        port = DEFAULT_ENGINE_PORT if _port_is_free(DEFAULT_ENGINE_PORT) else free_port()
        argv = [*_tern_command(), "engine", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--model", self.options.model] if self.options.model else []
        argv += ["--device", self.options.device] if self.options.device else []
        engine = self._start_child("engine", argv)
        self.env["TERN_ENGINE_URLS"] = f"http://127.0.0.1:{port}"
        model = self.options.model or "the default model"
        print(f"Engine: loading {model} on port {port}, log {engine.log_path}", flush=True)

    def start_gateway(self) -> None:
        argv = [*_tern_command(), "gateway", "--host", self.options.host, "--port", str(self.options.port)]
        gateway = self._start_child("gateway", argv)
        print(f"Gateway: starting on port {self.options.port}, log {gateway.log_path}", flush=True)

    def _start_child(self, name: str, argv: list[str]) -> Child:
        child = Child(name, argv, dict(self.env), self.state.logs / f"{name}.log")
        with self.signals.deferred():
            child.start()
            self.cleanup.callback(_announce_and_call, f"stopping the {name}", child.stop)
            self.watchdog.watch(signal.SIGTERM, -child.pid)
        self.children.append(child)
        self.pids[name] = child.pid
        return child

    def check_children(self) -> None:
        for child in self.children:
            code = child.exited()
            if code is not None:
                raise StackError(
                    f"the {child.name} exited with code {code}. "
                    f"Last lines of {child.log_path}:\n{child.log_tail()}"
                )


def up(options: UpOptions) -> int:
    """Start everything, wait for readiness, print the welcome, and run until a stop signal."""
    if not _port_is_free(options.port, options.host):
        raise StackError(f"port {options.port} is in use; set TERN_GATEWAY_PORT or pass --port")
    state = StateDir(options.data_dir.resolve())
    state.prepare()
    connect_host = "127.0.0.1" if options.host in ("0.0.0.0", "::") else options.host
    url = f"http://{connect_host}:{options.port}"
    started = time.monotonic()

    with contextlib.ExitStack() as cleanup, StopSignals() as signals:
        stack = Stack(options, state, cleanup, signals)
        admin_key = stack.load_secrets()
        stack.start_postgres()
        stack.start_redis()
        stack.migrate()
        stack.start_engine()
        stack.start_gateway()
        _wait_ready(url, stack, options.ready_timeout_s)
        demo_key = _ensure_demo_key(url, admin_key, state)
        model = _model_id(url, demo_key)
        ready_after_s = round(time.monotonic() - started, 1)

        run_info = {
            "gateway_url": url,
            "postgres_dsn": _libpq_dsn(stack.env["TERN_DATABASE_URL"]),
            "redis_url": stack.env["TERN_REDIS_URL"],
            "engine_urls": stack.env["TERN_ENGINE_URLS"].split(","),
            "pids": stack.pids,
            "ready_after_s": ready_after_s,
        }
        state.run_file.write_text(json.dumps(run_info, indent=2) + "\n")
        cleanup.callback(state.run_file.unlink, missing_ok=True)
        print(_banner(url=url, admin_key=admin_key, demo_key=demo_key, model=model, state=state), flush=True)
        print(f"Ready in {ready_after_s} s.", flush=True)

        try:
            while True:
                stack.check_children()
                time.sleep(0.5)
        except StopRequested as stop:
            print(f"\n{stop}: shutting down", flush=True)
            return 0


def _announce_and_call(message: str, stop: Callable[[], None]) -> None:
    print(f"  {message}", flush=True)
    stop()


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="tern up",
        description="Start PostgreSQL, Redis, an engine and the gateway on this machine; Ctrl-C stops them.",
    )
    parser.add_argument("--model", help="a Hugging Face directory or GGUF file (default: the built-in model)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], help="engine device (default: auto)")
    parser.add_argument(
        "--host",
        default=os.environ.get("TERN_GATEWAY_HOST", "127.0.0.1"),
        help="gateway listen address (default: TERN_GATEWAY_HOST or 127.0.0.1)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=os.environ.get("TERN_GATEWAY_PORT", str(DEFAULT_GATEWAY_PORT)),
        help="gateway port (default: TERN_GATEWAY_PORT or 8000)",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(os.environ.get("TERN_DATA_DIR", ".tern")),
        metavar="DIR",
        help="databases, secrets and logs (default: TERN_DATA_DIR or .tern)",
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=READY_TIMEOUT_S,
        dest="ready_timeout_s",
        metavar="SECONDS",
        help=f"give up if /readyz is not 200 by then (default: {READY_TIMEOUT_S:.0f})",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    options = UpOptions(
        model=args.model,
        device=args.device,
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        ready_timeout_s=args.ready_timeout_s,
    )
    try:
        return up(options)
    except StopRequested as stop:
        print(f"\n{stop}: stopped while starting", flush=True)
        return 130
    except (StackError, ServiceError, httpx.HTTPError) as error:
        print(f"\ntern up: {error}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
