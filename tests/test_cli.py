"""The ``tern`` command as a user runs it: in a fresh process.

It loads only what a subcommand needs (the gateway's never import torch or the engine's runtime, the
engine's never import the gateway); ``tern admin`` works outside pytest, finds the stack ``make up``
started, and fails with one line.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import asyncpg
import pytest

from gateway.keys.format import hash_key
from tern_stack.services import PostgresServer, free_port
from tern_stack.state import libpq_dsn


def _modules_after(code: str, *, submodules: bool = False) -> set[str]:
    """Top-level packages (with ``submodules``: all modules) that ``code`` imports in a fresh interpreter."""
    names = "sys.modules" if submodules else "{m.split('.')[0] for m in sys.modules}"
    program = textwrap.dedent(code) + f"\nimport sys; print(' '.join(sorted({names})))"
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def test_gateway_subcommands_never_import_torch() -> None:
    loaded = _modules_after(
        """
        from tern_cli.main import build_parser
        for argv in (["gateway"], ["migrate"], ["admin", "create-tenant", "x"], ["admin", "report"]):
            build_parser().parse_args(argv)
        import gateway.app, gateway.db
        """,
        submodules=True,
    )
    assert "gateway" in loaded
    assert not loaded & {"torch", "triton"}
    # Of the local stack, only its state-file format (standard library only), which tern_cli reads.
    assert {m for m in loaded if m.split(".")[0] == "tern_stack"} <= {"tern_stack", "tern_stack.run_file"}


@pytest.mark.parametrize("command", ["engine", "quantize"])
def test_engine_subcommands_never_import_the_gateway(command: str) -> None:
    loaded = _modules_after(
        f"""
        from tern_cli import main
        try:
            main([{command!r}, "--help"])
        except SystemExit:
            pass
        """,
        submodules=True,
    )
    assert "engine" in loaded
    assert not {m for m in loaded if m.split(".")[0] == "gateway"}
    assert {m for m in loaded if m.split(".")[0] == "tern_stack"} <= {"tern_stack", "tern_stack.run_file"}


def test_python_dash_m_tern_cli_is_the_tern_command() -> None:
    result = subprocess.run([sys.executable, "-m", "tern_cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for command in ("gateway", "engine", "migrate", "admin", "quantize", "up", "bench"):
        assert command in result.stdout


# ---------------------------------------------------------------- tern admin, as a user runs it


SECRET = "cli-subprocess-test-secret-0123456789"


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment without any Tern or database setting, plus ``extra``."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("TERN_") and name not in ("DATABASE_URL", "REDIS_URL")
    }
    return {**env, **extra}


def tern(*argv: str, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``tern ARGV`` in a fresh interpreter, the way a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "tern_cli", *argv],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    assert result.returncode == 1, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tern: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for text in expected:
        assert text in lines[0], lines[0]


def _stored_key_hashes(database_url: str) -> set[str]:
    async def fetch() -> set[str]:
        conn = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            return {row["secret_hash"] for row in await conn.fetch("SELECT secret_hash FROM api_keys")}
        finally:
            await conn.close()

    return asyncio.run(fetch())


def test_admin_create_tenant_works_in_a_fresh_process(database_url: str) -> None:
    """Issue 18, defect 1: the audit row's foreign key to api_keys resolved only under pytest."""
    result = tern("admin", "create-tenant", "acme", env=_clean_env(TERN_DATABASE_URL=database_url))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["name"] == "acme"


def _fake_running_stack(data_dir: Path, database_url: str) -> None:
    """What ``tern up`` leaves in its data dir while it runs: ``run.json`` and the secret file."""
    data_dir.mkdir(parents=True)
    run_info = {"gateway_url": "http://127.0.0.1:9", "postgres_dsn": libpq_dsn(database_url), "pids": {}}
    (data_dir / "run.json").write_text(json.dumps(run_info))
    (data_dir / "secret").write_text(SECRET + "\n")


def test_admin_finds_the_running_stack_by_itself(database_url: str, tmp_path: Path) -> None:
    """Issue 18, defect 2: beside `make up`, `tern admin` needs no database URL and no TERN_SECRET."""
    _fake_running_stack(tmp_path / ".tern", database_url)
    made = tern("admin", "create-key", "--name", "ops", "--kind", "admin", env=_clean_env(), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    key = json.loads(made.stdout)["key"]
    assert hash_key(key, SECRET.encode()) in _stored_key_hashes(database_url), (
        "hashed with the stack's secret"
    )

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    by_flag = tern(
        "admin", "create-tenant", "t", "--data-dir", str(tmp_path / ".tern"), env=_clean_env(), cwd=elsewhere
    )
    assert by_flag.returncode == 0, by_flag.stderr
    report = tern(
        "admin",
        "report",
        "--format",
        "json",
        env=_clean_env(TERN_DATA_DIR=str(tmp_path / ".tern")),
        cwd=elsewhere,
    )
    assert report.returncode == 0, report.stderr


def test_admin_errors_are_one_line(
    postgres_server: PostgresServer, fresh_database_name: Callable[..., str], tmp_path: Path
) -> None:
    """Issue 18, defect 2: no tracebacks, and each line says what to do."""
    unreachable = f"postgresql://postgres@127.0.0.1:{free_port()}/tern"
    result = tern("admin", "create-tenant", "x", env=_clean_env(TERN_DATABASE_URL=unreachable), cwd=tmp_path)
    assert_one_line_error(result, "cannot reach the database", "make up")

    result = tern("admin", "create-tenant", "x", "--data-dir", str(tmp_path / "none"), env=_clean_env())
    assert_one_line_error(result, "no running stack", "tern up")

    empty = postgres_server.url(fresh_database_name(prefix="tern_cli_empty"))
    result = tern("admin", "create-tenant", "x", env=_clean_env(TERN_DATABASE_URL=empty))
    assert_one_line_error(result, "tern migrate")

    result = tern("gateway", env=_clean_env(TERN_ADMIN_KEY="too-short"))
    assert_one_line_error(result, "TERN_ADMIN_KEY")


UNUSABLE_ADMIN_KEY = "tern_admin_" + "0123456789abcdef" * 2
"""Issue 18, defect 12: shaped like the docs allow, but ``tern_`` keys must carry a Tern checksum."""


def test_gateway_refuses_an_admin_key_that_could_never_authenticate() -> None:
    result = tern("gateway", env=_clean_env(TERN_ADMIN_KEY=UNUSABLE_ADMIN_KEY, TERN_SECRET=SECRET))
    assert_one_line_error(result, "TERN_ADMIN_KEY", "tern_")


def test_tern_up_refuses_an_admin_key_that_could_never_authenticate(tmp_path: Path) -> None:
    """Refused before any server starts, in one line (it used to fail later with a 401)."""
    data_dir = tmp_path / ".tern"
    env = _clean_env(TERN_ADMIN_KEY=UNUSABLE_ADMIN_KEY, TERN_GATEWAY_PORT=str(free_port()))
    result = tern("up", "--data-dir", str(data_dir), env=env)
    assert result.returncode == 1, result
    assert [line for line in result.stderr.splitlines() if line] == [
        result.stderr.strip()
    ] and "TERN_ADMIN_KEY" in result.stderr, result.stderr
    assert "PostgreSQL" not in result.stdout and not (data_dir / "postgres").exists()
