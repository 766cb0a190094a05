"""``tern up``: what starts, in which order, and how it is stopped.

In order: PostgreSQL and Redis (embedded, data under ``.tern/``; skipped when ``DATABASE_URL`` /
``REDIS_URL`` point elsewhere), the migrations, one engine (skipped when ``TERN_ENGINE_URLS`` names
engines already running), one gateway. Once ``/readyz`` answers 200 it makes sure a demo tenant and
inference key exist and prints how to call the API. From then on a crashed engine or gateway is
restarted with backoff (:mod:`tern_stack.restarts`) while everything else keeps running (a restarted
gateway replays the usage its predecessor journaled and bills the streams it cut); before that, any
exit is fatal (a model that cannot load would only crash again). Ctrl-C or SIGTERM stops everything in
reverse order (see :mod:`tern_stack.processes` for how children and the watchdog behave).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway.keys.format import bootstrap_key_problem, generate_key
from tern_stack.banner import banner
from tern_stack.demo import ensure_demo_key, model_id
from tern_stack.processes import (
    Child,
    StopRequested,
    StopSignals,
    Watchdog,
    announce_and_call,
    tern_command,
)
from tern_stack.restarts import Restarter
from tern_stack.run_file import RunInfo
from tern_stack.services import PostgresServer, RedisServer, free_port, port_is_free
from tern_stack.state import StateDir, libpq_dsn

DEFAULT_GATEWAY_PORT = 8000
DEFAULT_ENGINE_PORT = 8100
DATABASE_NAME = "tern"
READY_TIMEOUT_S = 600.0


class StackError(RuntimeError):
    """The stack could not start; the message says why and where the logs are."""


def postmaster_pid(server: PostgresServer) -> int:
    return int((server.data_dir / "postmaster.pid").read_text().split()[0])


def redis_pid(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return int(client.info("server")["process_id"])
    finally:
        client.close()


READY_POLL_FIRST_S = 0.1
READY_POLL_MAX_S = 1.0


def _poll_until_ok(url: str, stack: Stack, deadline: float, *, waiting_for: str, timeout_s: float) -> None:
    """GET ``url`` until 200, with growing pauses; print each new reason for waiting once."""
    pause, last_note = READY_POLL_FIRST_S, ""
    with httpx.Client(timeout=2.0) as client:
        while True:
            stack.check_children()
            try:
                response = client.get(url)
                if response.status_code == 200:
                    return
                note = f"{url.rsplit('/', 1)[-1]} {response.status_code} {response.text[:200]}"
            except httpx.HTTPError:
                note = waiting_for
            if note != last_note:
                print(f"  waiting: {note}", flush=True)
                last_note = note
            if time.monotonic() > deadline:
                raise StackError(f"{url} was not 200 after {timeout_s:.0f} s (last: {note})")
            time.sleep(pause)
            pause = min(pause * 2, READY_POLL_MAX_S)


def wait_ready(url: str, stack: Stack, timeout_s: float) -> None:
    """Wait for the engine we started, then for the gateway's ``/readyz``; fail fast if a child exits.

    The engine is asked first, on its ``/health`` (which its access log leaves out), because loading
    a model takes the longest: asking the gateway all that time would write an access-log line per
    poll into gateway.log. Once the engine answers, the gateway is ready within one health probe.
    """
    deadline = time.monotonic() + timeout_s
    if stack.engine_url is not None:
        _poll_until_ok(
            f"{stack.engine_url}/health",
            stack,
            deadline,
            waiting_for="the engine is loading the model",
            timeout_s=timeout_s,
        )
    _poll_until_ok(
        f"{url}/readyz", stack, deadline, waiting_for="the gateway is not listening yet", timeout_s=timeout_s
    )


@dataclass
class UpOptions:
    model: str | None
    device: str | None
    host: str
    port: int
    data_dir: Path
    ready_timeout_s: float
    served_model_name: str | None = None


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
        if "TERN_USAGE_SPOOL_DIR" not in self.env:  # the deprecated name, if given, still decides
            self.env.setdefault("TERN_USAGE_JOURNAL_DIR", str(state.root / "spool" / "usage" / "journal"))
        self.children: list[Child] = []
        self.pids: dict[str, int] = {}
        self.run_info: RunInfo | None = None
        self.restarters: dict[str, Restarter] = {}
        self.engine_url: str | None = None
        """The engine this stack started (None when TERN_ENGINE_URLS names running ones)."""
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
        problem = bootstrap_key_problem(admin_key)
        if problem is not None:  # the gateway would refuse it too, with a traceback in its log
            raise StackError(problem)
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
                self.cleanup.callback(announce_and_call, "stopping PostgreSQL", postgres.stop)
                self.pids["postgres"] = postmaster_pid(postgres)
                self.watchdog.watch(signal.SIGINT, self.pids["postgres"])  # SIGINT: fast shutdown
            postgres.create_database(DATABASE_NAME, exist_ok=True)  # the cluster starts with only `postgres`
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
                self.cleanup.callback(announce_and_call, "stopping Redis", server.stop)
                redis_url = server.url()
                self.pids["redis"] = redis_pid(redis_url)
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
            if self.options.served_model_name:
                raise StackError(
                    "--served-model-name names the engine tern up starts; with TERN_ENGINE_URLS set, "
                    "give it to those engines"
                )
            print(f"Engine: using {engine_urls} (TERN_ENGINE_URLS)", flush=True)
            return
        port = DEFAULT_ENGINE_PORT if port_is_free(DEFAULT_ENGINE_PORT) else free_port()
        argv = [*tern_command(), "engine", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--model", self.options.model] if self.options.model else []
        argv += ["--device", self.options.device] if self.options.device else []
        if self.options.served_model_name:
            argv += ["--served-model-name", self.options.served_model_name]
        engine = self._start_child("engine", argv)
        self.engine_url = f"http://127.0.0.1:{port}"
        self.env["TERN_ENGINE_URLS"] = self.engine_url
        model = self.options.model or "the default model"
        print(f"Engine: loading {model} on port {port}, log {engine.log_path}", flush=True)

    def start_gateway(self) -> None:
        argv = [*tern_command(), "gateway", "--host", self.options.host, "--port", str(self.options.port)]
        gateway = self._start_child("gateway", argv)
        print(f"Gateway: starting on port {self.options.port}, log {gateway.log_path}", flush=True)

    def _start_child(self, name: str, argv: list[str]) -> Child:
        child = Child(name, argv, dict(self.env), self.state.logs / f"{name}.log")
        with self.signals.deferred():
            child.start()
            self.cleanup.callback(announce_and_call, f"stopping the {name}", child.stop)
            self.watchdog.watch(signal.SIGTERM, -child.pid)
        self.children.append(child)
        self.pids[name] = child.pid
        return child

    def check_children(self) -> None:
        """Fail if a child exited (while starting, and for children that are not restarted)."""
        for child in self.children:
            code = child.exited()
            if code is not None and child.name not in self.restarters:
                raise StackError(
                    f"the {child.name} exited with code {code}. "
                    f"Last lines of {child.log_path}:\n{child.log_tail()}"
                )

    def restart_crashed_children(self) -> None:
        """Once the stack is up, an engine or gateway that exits is started again instead of stopping
        the stack."""
        for child in self.children:
            if child.name in ("engine", "gateway"):
                self.restarters[child.name] = Restarter(child, start=self._restart)

    def supervise(self) -> None:
        """One round of the main loop: restart what is due, fail on any other exit."""
        for restarter in self.restarters.values():
            restarter.poll()
        self.check_children()

    def _restart(self, child: Child) -> None:
        with self.signals.deferred():
            child.restart()
            self.watchdog.watch(signal.SIGTERM, -child.pid)
        self.pids[child.name] = child.pid
        if self.run_info is not None:
            self.state.write_run_info(self.run_info)  # tools read the new pid from run.json


def up(options: UpOptions) -> int:
    """Start everything, wait for readiness, print the welcome, and run until a stop signal."""
    if not port_is_free(options.port, options.host):
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
        wait_ready(url, stack, options.ready_timeout_s)
        demo_key = ensure_demo_key(url, admin_key, state)
        model = model_id(url, demo_key)
        ready_after_s = round(time.monotonic() - started, 1)

        stack.run_info = run_info = RunInfo(
            gateway_url=url,
            postgres_dsn=libpq_dsn(stack.env["TERN_DATABASE_URL"]),
            redis_url=stack.env["TERN_REDIS_URL"],
            engine_urls=stack.env["TERN_ENGINE_URLS"].split(","),
            pids=stack.pids,
            ready_after_s=ready_after_s,
        )
        state.write_run_info(run_info)
        cleanup.callback(state.run_file.unlink, missing_ok=True)
        print(banner(url=url, admin_key=admin_key, demo_key=demo_key, model=model, state=state), flush=True)
        print(f"Ready in {ready_after_s} s.", flush=True)

        stack.restart_crashed_children()
        try:
            while True:
                stack.supervise()
                time.sleep(0.5)
        except StopRequested as stop:
            print(f"\n{stop}: shutting down", flush=True)
            return 0
