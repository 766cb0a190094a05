"""What ``tern up`` keeps under ``.tern/`` between runs: server data, secrets, logs and ``run.json``."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tern_stack.run_file import RunInfo, run_file, write_run_info


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
        """Where the running stack's URLs and process ids are written (``tern_stack/run_file.py``)."""
        return run_file(self.root)

    def write_run_info(self, info: RunInfo) -> None:
        write_run_info(self.root, info)

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


def libpq_dsn(database_url: str) -> str:
    """The SQLAlchemy URL as psql and pg_dump take it (``run.json``'s ``postgres_dsn``)."""
    scheme, rest = database_url.split("://", 1)
    return f"{scheme.split('+')[0]}://{rest}"
