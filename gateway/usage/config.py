"""Settings for usage metering (``TERN_USAGE_*``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gateway.usage.journal_sync import SyncerKind

DEFAULT_DIR = Path(".tern/spool/usage")


class UsageSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TERN_USAGE_", extra="ignore")

    flush_interval_s: float = Field(0.25, gt=0, description="A buffered record waits at most this long.")
    batch_size: int = Field(500, gt=0, description="Records per INSERT; a full batch flushes at once.")
    journal_dir: Path | None = Field(
        None,
        description="The usage journal, the one on-disk queue of usage (default: <spool_dir>/journal).",
    )
    spool_dir: Path = Field(
        DEFAULT_DIR,
        description="Deprecated (use TERN_USAGE_JOURNAL_DIR): the journal's parent when that is not "
        "given, and where batches an older gateway spooled wait to be replayed once.",
    )
    journal_fsync: bool = Field(
        True,
        description="fsync each journal batch: usage survives a machine crash, not only the gateway's.",
    )
    journal_commit_interval_ms: float = Field(
        5.0,
        ge=0,
        description="Under load, journal syncs start at most this often (each then serves more requests).",
    )
    journal_syncer: SyncerKind = Field(
        "process",
        description="How a batch is fsynced off the event loop: a child process or, where that "
        "cannot start, a thread ('aio', retired, means the thread).",
    )
    replay_interval_s: float = Field(
        1.0, gt=0, description="How often a failed write and dead processes' journals are retried."
    )
    retention_months: int = Field(
        0, ge=0, description="Drop raw rows' monthly partitions older than this many months (0: keep all)."
    )
    partitions_ahead: int = Field(2, ge=1, description="Monthly partitions created ahead of time.")
    maintenance_interval_s: float = Field(3600.0, gt=0)

    @field_validator("journal_syncer", mode="before")
    @classmethod
    def _retired_syncer(cls, value: object) -> object:
        """``aio`` was retired (docs/limits-and-billing.md): a deployment that still names it gets the
        fallback it would have fallen back to anyway, not a gateway that will not start."""
        return "thread" if value == "aio" else value

    @property
    def journal_path(self) -> Path:
        return self.journal_dir or self.spool_dir / "journal"

    @property
    def legacy_spool_dir(self) -> Path:
        """Where a gateway before the one queue spooled batches (``*.jsonl``): replayed once."""
        if self.journal_dir is not None and "spool_dir" not in self.model_fields_set:
            return self.journal_dir.parent
        return self.spool_dir
