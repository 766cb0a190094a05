"""An on-disk spool for usage batches Postgres could not take.

Each batch is one JSON-lines file, written to a temporary name, fsynced and renamed, so a file
either holds a whole batch or does not exist. Replaying is safe to repeat (and safe for two
processes to do at once): rows are keyed by request id and inserted with ``ON CONFLICT DO NOTHING``.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from gateway.usage.schemas import UsageRecord


class Spool:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def write(self, records: list[UsageRecord]) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"{time.time_ns():020d}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        tmp = self.directory / f".{name}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps(record.to_json(), separators=(",", ":")) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        final = self.directory / name
        os.replace(tmp, final)
        return final

    def files(self) -> list[Path]:
        """Spooled batches, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.glob("*.jsonl") if p.is_file())

    @staticmethod
    def read(path: Path) -> list[UsageRecord]:
        with open(path, encoding="utf-8") as handle:
            return [UsageRecord.from_json(json.loads(line)) for line in handle if line.strip()]

    @staticmethod
    def remove(path: Path) -> None:
        path.unlink(missing_ok=True)

    def quarantine(self, path: Path) -> Path:
        """Move a batch Postgres rejects for its content (not an outage) out of the replay loop."""
        target = self.directory / "rejected" / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
        return target
