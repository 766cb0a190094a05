"""Writing usage batches: raw rows and their daily rollups in one statement, exactly once.

The raw insert skips request ids already stored (``ON CONFLICT DO NOTHING``) and the rollup upsert
reads only the rows that insert actually wrote (``RETURNING``), in the same statement and
transaction. So a replayed batch changes nothing, and the rollups always equal the raw sums.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import fields
from datetime import date

from sqlalchemy import Uuid, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.usage.models import UsageRow
from gateway.usage.partitions import ensure_partitions, month_floor
from gateway.usage.schemas import UsageRecord

# The columns a batch writes: every column of the table that a record carries (``recorded_at`` is
# the server's), with their PostgreSQL types, read from the model so that they are written once.
_WRITTEN = [c for c in UsageRow.__table__.columns if c.name in {f.name for f in fields(UsageRecord)}]
_NAMES = [c.name for c in _WRITTEN]
_TYPES = [c.type.compile(dialect=postgresql.dialect()) for c in _WRITTEN]
_UUIDS = {c.name for c in _WRITTEN if isinstance(c.type, Uuid)}

INSERT_BATCH = text(
    f"""
WITH incoming AS (
    SELECT * FROM unnest({", ".join(f"CAST(:{n} AS {t}[])" for n, t in zip(_NAMES, _TYPES, strict=True))})
        AS t({", ".join(_NAMES)})
), inserted AS (
    INSERT INTO usage_records ({", ".join(_NAMES)})
    SELECT {", ".join(_NAMES)} FROM incoming
    ON CONFLICT DO NOTHING
    RETURNING started_at, tenant_id, key_id, model, status, finish_reason,
              prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens
), rolled AS (
    INSERT INTO usage_daily AS d
        (day, tenant_id, key_id, model, requests, errors, prompt_tokens, cached_tokens, completion_tokens,
         reasoning_tokens)
    SELECT (started_at AT TIME ZONE 'UTC')::date, tenant_id, key_id, model, count(*),
           count(*) FILTER (WHERE status >= 400 OR finish_reason = 'error'),
           sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens), sum(reasoning_tokens)
    FROM inserted
    GROUP BY 1, 2, 3, 4
    ORDER BY 1, 2, 3, 4
    ON CONFLICT (day, tenant_id, key_id, model) DO UPDATE SET
        requests = d.requests + excluded.requests,
        errors = d.errors + excluded.errors,
        prompt_tokens = d.prompt_tokens + excluded.prompt_tokens,
        cached_tokens = d.cached_tokens + excluded.cached_tokens,
        completion_tokens = d.completion_tokens + excluded.completion_tokens,
        reasoning_tokens = d.reasoning_tokens + excluded.reasoning_tokens
    RETURNING 1
)
SELECT count(*) FROM inserted
"""
)


def _columns(records: Sequence[UsageRecord]) -> dict[str, list[object]]:
    unique = list({r.request_id: r for r in records}.values())  # one statement may not hit a row twice
    params: dict[str, list[object]] = {name: [] for name in _NAMES}
    for r in unique:
        for name in _NAMES:
            value = getattr(r, name)
            if name in _UUIDS:
                value = uuid.UUID(str(value))
            params[name].append(value)
    return params


async def write_batch(engine: AsyncEngine, records: Sequence[UsageRecord], *, known_months: set[date]) -> int:
    """Store a batch exactly once; returns how many records were new. Raises if Postgres fails."""
    if not records:
        return 0
    months = {month_floor(r.started_at) for r in records}
    if not months <= known_months:
        async with engine.begin() as conn:
            await ensure_partitions(conn, months)
        known_months |= months
    async with engine.begin() as conn:
        result = await conn.execute(INSERT_BATCH, _columns(records))
        return int(result.scalar_one())
