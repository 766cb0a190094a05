"""Monthly range partitions of ``usage_records``: created ahead of time, dropped after retention.

Dropping a whole month's partition frees its space at once, where ``DELETE`` would leave dead
rows and bloat behind. Rollups in ``usage_daily`` are kept, so reports still cover old months.
"""

from __future__ import annotations

import re
from datetime import UTC, date, datetime

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

PARENT = "usage_records"
_NAME = re.compile(rf"^{PARENT}_p(\d{{4}})(\d{{2}})$")
_LOCK_ID = 0x7465726E  # "tern": serialises partition DDL across gateway processes


def add_months(month: date, n: int) -> date:
    index = month.year * 12 + month.month - 1 + n
    return date(index // 12, index % 12 + 1, 1)


def month_floor(value: datetime | date) -> date:
    return date(value.year, value.month, 1)


def partition_name(month: date) -> str:
    return f"{PARENT}_p{month.year:04d}{month.month:02d}"


async def existing_partitions(conn: AsyncConnection) -> dict[date, str]:
    rows = await conn.execute(
        text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = :parent"
        ),
        {"parent": PARENT},
    )
    found: dict[date, str] = {}
    for (name,) in rows:
        match = _NAME.match(name)
        if match:
            found[date(int(match[1]), int(match[2]), 1)] = name
    return found


async def ensure_partitions(conn: AsyncConnection, months: set[date]) -> None:
    """Create the partitions of ``months`` that do not exist yet (call inside a transaction)."""
    await conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _LOCK_ID})
    have = await existing_partitions(conn)
    for month in sorted(months - have.keys()):
        start, end = month, add_months(month, 1)
        await conn.execute(
            text(
                f'CREATE TABLE IF NOT EXISTS "{partition_name(month)}" PARTITION OF {PARENT} '
                f"FOR VALUES FROM ('{start.isoformat()} 00:00:00+00') TO ('{end.isoformat()} 00:00:00+00')"
            )
        )


async def drop_expired_partitions(conn: AsyncConnection, *, retention_months: int, today: date) -> list[str]:
    """Drop partitions of months that ended more than ``retention_months`` months before this one."""
    if retention_months <= 0:
        return []
    oldest_kept = add_months(month_floor(today), -retention_months)
    await conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _LOCK_ID})
    dropped = []
    for month, name in sorted((await existing_partitions(conn)).items()):
        if month < oldest_kept:
            await conn.execute(text(f'DROP TABLE IF EXISTS "{name}"'))
            dropped.append(name)
    return dropped


async def maintain(conn: AsyncConnection, *, ahead: int, retention_months: int) -> list[str]:
    """Create this month and ``ahead`` more; drop expired months. Returns the dropped partitions."""
    this_month = month_floor(datetime.now(UTC))
    await ensure_partitions(conn, {add_months(this_month, i) for i in range(ahead + 1)})
    return await drop_expired_partitions(conn, retention_months=retention_months, today=this_month)
