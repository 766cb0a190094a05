"""Settings for usage metering (``TERN_USAGE_*``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from gateway.usage.journal_sync import SyncerKind


class UsageSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TERN_USAGE_", extra="ignore")

    flush_interval_s: float = Field(0.25, gt=0, description="A buffered record waits at most this long.")
    batch_size: int = Field(500, gt=0, description="Records per INSERT; a full batch flushes at once.")
    spool_dir: Path = Field(
        Path(".tern/spool/usage"), description="Batches Postgres refused wait here until it is back."
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
        description="How a batch is fsynced off the event loop: a child process, kernel AIO (Linux "
        "x86_64/aarch64; elsewhere the thread) or a thread.",
    )
    replay_interval_s: float = Field(1.0, gt=0, description="How often spooled batches are retried.")
    retention_months: int = Field(
        0, ge=0, description="Drop raw rows' monthly partitions older than this many months (0: keep all)."
    )
    partitions_ahead: int = Field(2, ge=1, description="Monthly partitions created ahead of time.")
    maintenance_interval_s: float = Field(3600.0, gt=0)
