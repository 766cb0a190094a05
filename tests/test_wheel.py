"""The built wheel works on its own: ``tern migrate`` from an installed wheel, outside the checkout.

Builds the tern-serve wheel offline (``pip wheel --no-deps --no-build-isolation --no-index``, from a
copy of the sources so the checkout gets no ``build/``), installs it with ``--no-deps`` into a
temporary target, and runs that install's ``tern`` console script from a folder outside the
repository against a fresh database on the test session's PostgreSQL. The dependencies come from
this interpreter's environment; the code, the migrations included, only from the wheel.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tern_stack.services import PostgresServer

ROOT = Path(__file__).resolve().parents[1]

SHIPPED = [
    "migrations/__init__.py",
    "migrations/env.py",
    "migrations/script.py.mako",
    "migrations/versions/0001_core.py",
    "tern_cli/__main__.py",
    "tern_stack/services.py",
    "gateway/db.py",
    "engine/data/calibration.txt",
    "engine/kernels/tuning_table.json",
    "bench/__init__.py",
    "bench/engine/serving.py",
    "bench/gateway/gateway.py",
]


def _pip(*args: str, cwd: Path) -> None:
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, env=env, check=True, capture_output=True)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``pip install --target`` of the freshly built wheel; returns the target folder."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for package in sorted(path.parent for path in ROOT.glob("*/__init__.py")):
        if package.name != "tests":
            shutil.copytree(package, source / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    _pip(
        "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(work / "dist"), str(source), cwd=work
    )
    (wheel,) = (work / "dist").glob("tern_serve-*.whl")

    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in SHIPPED if name not in names]
    assert not missing, f"not in {wheel.name}: {missing}"
    assert not any(name.startswith("tests/") for name in names)

    target = work / "site"
    _pip("install", "--no-deps", "--target", str(target), str(wheel), cwd=work)
    return target


def _run_installed(
    target: Path, *argv: str, env: dict[str, str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv),
        cwd=cwd,
        env={**env, "PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_tern_migrate_from_the_installed_wheel(
    installed: Path,
    postgres_server: PostgresServer,
    fresh_database_name: Callable[..., str],
    tmp_path: Path,
) -> None:
    elsewhere = tmp_path / "elsewhere"  # not the checkout: nothing can come from the repository
    elsewhere.mkdir()
    database = fresh_database_name(prefix="tern_wheel")
    env = {
        **{key: value for key, value in os.environ.items() if not key.startswith("TERN_")},
        "TERN_DATABASE_URL": postgres_server.url(database),
        "TERN_SECRET": "wheel-test-secret-0123456789",
    }

    where = _run_installed(
        installed,
        sys.executable,
        "-c",
        "import gateway.db, migrations, tern_cli; "
        "print(gateway.db.migrations_dir()); print(migrations.__file__); print(tern_cli.__file__)",
        env=env,
        cwd=elsewhere,
    )
    assert where.returncode == 0, where.stderr
    for line in where.stdout.splitlines():
        assert Path(line).is_relative_to(installed), f"imported from outside the wheel: {line}"

    migrate = _run_installed(installed, str(installed / "bin" / "tern"), "migrate", env=env, cwd=elsewhere)
    assert migrate.returncode == 0, migrate.stderr
    assert "database upgraded to head" in migrate.stdout

    from alembic.script import ScriptDirectory

    from gateway.db import alembic_config

    head = ScriptDirectory.from_config(alembic_config(postgres_server.url(database))).get_current_head()
    assert _alembic_version(postgres_server, database) == head


def _alembic_version(server: PostgresServer, database: str) -> str:
    import asyncpg

    async def fetch() -> str:
        conn = await asyncpg.connect(server.url(database, driver=""))
        try:
            return str(await conn.fetchval("SELECT version_num FROM alembic_version"))
        finally:
            await conn.close()

    return asyncio.run(fetch())
