"""The local stack's state files, as one typed module: where the data dir is, and ``run.json``.

``tern up`` writes ``run.json`` in its data dir while it runs (URLs, the PostgreSQL DSN, process
ids) and deletes it when it stops; ``tern status``, ``tern admin``, ``tern migrate`` and
``tern chat`` (``tern_cli/local_stack.py``) read it. Both sides go through :class:`RunInfo`, so the
file's fields are written down once. Imports nothing beyond the standard library.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DATA_DIR_ENV = "TERN_DATA_DIR"
DEFAULT_DATA_DIR = Path(".tern")
RUN_FILE_NAME = "run.json"


def default_data_dir() -> Path:
    """``TERN_DATA_DIR`` or ``.tern``: where ``tern up`` keeps its state and the other commands look."""
    return Path(os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR)


@dataclass
class RunInfo:
    """What ``run.json`` holds."""

    gateway_url: str
    postgres_dsn: str | None = None
    """libpq form (``postgresql://...``), as psql and pg_dump take it."""
    redis_url: str | None = None
    engine_urls: list[str] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)
    """Process id by child name; rewritten when ``tern up`` restarts a child."""
    ready_after_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunInfo:
        return cls(
            gateway_url=str(data["gateway_url"]),
            postgres_dsn=data.get("postgres_dsn"),
            redis_url=data.get("redis_url"),
            engine_urls=list(data.get("engine_urls", [])),
            pids={str(name): int(pid) for name, pid in data.get("pids", {}).items()},
            ready_after_s=data.get("ready_after_s"),
        )


def run_file(data_dir: Path) -> Path:
    return data_dir / RUN_FILE_NAME


def read_run_info(data_dir: Path) -> RunInfo | None:
    """``run.json`` if a ``tern up`` is running there; None if it is absent or unreadable."""
    try:
        return RunInfo.from_json(json.loads(run_file(data_dir).read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_run_info(data_dir: Path, info: RunInfo) -> None:
    """Written whole, then renamed into place: whoever waits for ``run.json`` to appear (tests,
    tools) never reads it half written."""
    path = run_file(data_dir)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(info.to_json(), indent=2) + "\n")
    partial.replace(path)
