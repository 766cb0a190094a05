"""The stack ``tern up`` (``make up``) started, as the other ``tern`` commands find it.

``tern up`` keeps its secrets in its data dir and, while it runs, writes ``run.json`` there (URLs,
the PostgreSQL DSN, process ids). ``tern admin``, ``tern migrate``, ``tern status`` and ``tern chat``
read them so that, beside a running ``make up``, they work with no variables set. Variables the user
did set always win: a production operator points ``TERN_DATABASE_URL`` at the real database.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tern_stack.run_file import RunInfo, default_data_dir, read_run_info, run_file

DATABASE_URL_ENV = ("TERN_DATABASE_URL", "DATABASE_URL")
REDIS_URL_ENV = ("TERN_REDIS_URL", "REDIS_URL")
SECRET_ENV = "TERN_SECRET"


def _env(*names: str) -> str | None:
    return next((os.environ[name] for name in names if os.environ.get(name)), None)


@dataclass(frozen=True)
class LocalStack:
    """What a data dir holds; every accessor is None when the file is not there."""

    data_dir: Path

    @classmethod
    def find(cls, data_dir: Path | None = None) -> LocalStack:
        return cls((data_dir or default_data_dir()).expanduser())

    @property
    def run_file(self) -> Path:
        return run_file(self.data_dir)

    def run_info(self) -> RunInfo | None:
        """``run.json`` if a ``tern up`` is running (it deletes the file when it stops)."""
        return read_run_info(self.data_dir)

    def file_path(self, name: str) -> Path:
        return self.data_dir / name

    def read(self, name: str) -> str | None:
        """A secret file (``secret``, ``admin_key``, ``demo_key``), stripped; None if unreadable."""
        try:
            return self.file_path(name).read_text().strip() or None
        except OSError:
            return None

    def gateway_url(self) -> str | None:
        info = self.run_info()
        return None if info is None else info.gateway_url

    def settings_overrides(self) -> dict[str, str]:
        """Gateway settings to take from this stack: only those the environment does not set."""
        overrides: dict[str, str] = {}
        info = self.run_info()
        if info is not None and _env(*DATABASE_URL_ENV) is None and info.postgres_dsn:
            overrides["database_url"] = info.postgres_dsn
        if info is not None and _env(*REDIS_URL_ENV) is None and info.redis_url:
            overrides["redis_url"] = info.redis_url
        secret = self.read("secret")
        if secret is not None and _env(SECRET_ENV) is None:
            overrides["secret"] = secret
        return overrides
