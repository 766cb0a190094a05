"""Prices (admin-managed) and reports over the daily rollups.

Reports read ``usage_daily``, not raw rows: it is small, indexed by day, and survives the raw
rows' retention. Costs are summed exactly in Postgres numerics and divided by 1e6 in Python.
"""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import delete, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from gateway.audit.service import record
from gateway.auth.identity import Actor
from gateway.exceptions import InvalidInput, PlatformAdminRequired
from gateway.reports.exceptions import PriceExists, PriceNotFound
from gateway.reports.models import ModelPrice
from gateway.reports.pricing import COST_MICRO_SQL, PRICE_LATERAL, from_micro, money_str
from gateway.reports.schemas import GROUP_FIELDS, Bill, BillLine, PriceCreate, PriceOut
from gateway.usage.partitions import add_months

# ---------------------------------------------------------------- prices


def _require_platform(actor: Actor) -> None:
    if not actor.is_platform:
        raise PlatformAdminRequired("change prices")


async def create_price(session: AsyncSession, *, actor: Actor, body: PriceCreate) -> ModelPrice:
    _require_platform(actor)
    price = ModelPrice(
        model=body.model,
        effective_from=body.effective_from or datetime.now(UTC).date(),
        prompt_per_mtok=body.prompt_per_mtok,
        cached_prompt_per_mtok=(
            body.prompt_per_mtok if body.cached_prompt_per_mtok is None else body.cached_prompt_per_mtok
        ),
        completion_per_mtok=body.completion_per_mtok,
    )
    session.add(price)
    try:
        await session.flush()
    except IntegrityError:
        await session.rollback()
        raise PriceExists(body.model, price.effective_from) from None
    await session.refresh(price)
    record(
        session,
        actor=actor,
        tenant_id=None,
        action="price.create",
        object_type="model_price",
        object_id=price.id,
        before=None,
        after=PriceOut.model_validate(price).model_dump(mode="json"),
    )
    await session.commit()
    return price


async def list_prices(session: AsyncSession, *, model: str | None) -> list[ModelPrice]:
    query = select(ModelPrice).order_by(ModelPrice.model, ModelPrice.effective_from)
    if model is not None:
        query = query.where(ModelPrice.model == model)
    return list((await session.scalars(query)).all())


async def delete_price(session: AsyncSession, *, actor: Actor, price_id: int) -> None:
    _require_platform(actor)
    price = await session.get(ModelPrice, price_id)
    if price is None:
        raise PriceNotFound(price_id)
    before = PriceOut.model_validate(price).model_dump(mode="json")
    await session.execute(delete(ModelPrice).where(ModelPrice.id == price_id))
    record(
        session,
        actor=actor,
        tenant_id=None,
        action="price.delete",
        object_type="model_price",
        object_id=price_id,
        before=before,
        after=None,
    )
    await session.commit()


# ---------------------------------------------------------------- usage report


def _filters(
    *,
    start: date,
    end: date,
    tenant_id: uuid.UUID | None,
    key_id: uuid.UUID | None,
    model: str | None,
    end_user: str | None = None,
) -> tuple[str, dict[str, Any]]:
    where = ["d.day >= :start", "d.day <= :end"]
    params: dict[str, Any] = {"start": start, "end": end}
    filters = (("tenant_id", tenant_id), ("key_id", key_id), ("model", model), ("end_user", end_user))
    for column, value in filters:
        if value is not None:
            where.append(f"d.{column} = :{column}")
            params[column] = value
    return " AND ".join(where), params


BY_END_USER = """(
    SELECT (r.started_at AT TIME ZONE 'UTC')::date AS day, r.tenant_id, r.key_id, r.model,
           coalesce(r.end_user, '') AS end_user, count(*) AS requests,
           count(*) FILTER (WHERE r.status >= 400 OR r.finish_reason = 'error') AS errors,
           sum(r.prompt_tokens) AS prompt_tokens, sum(r.cached_tokens) AS cached_tokens,
           sum(r.completion_tokens) AS completion_tokens, sum(r.reasoning_tokens) AS reasoning_tokens
    FROM usage_records r
    WHERE r.started_at >= :start_at AND r.started_at < :end_at
    GROUP BY 1, 2, 3, 4, 5
)"""
"""The daily rollup's shape with the end user added, from the raw rows (the rollups have no end user):
reports by end user reach back as far as ``TERN_USAGE_RETENTION_MONTHS`` keeps raw rows."""


def _metrics(row: Any) -> dict[str, Any]:
    prompt, completion = int(row.prompt_tokens or 0), int(row.completion_tokens or 0)
    return {
        "requests": int(row.requests or 0),
        "errors": int(row.errors or 0),
        "prompt_tokens": prompt,
        "cached_tokens": int(row.cached_tokens or 0),
        "completion_tokens": completion,
        "reasoning_tokens": int(row.reasoning_tokens or 0),
        "total_tokens": prompt + completion,
        "cost": from_micro(row.cost_micro),
    }


async def usage_report(
    session: AsyncSession,
    *,
    start: date,
    end: date,
    group_by: list[str],
    tenant_id: uuid.UUID | None = None,
    key_id: uuid.UUID | None = None,
    model: str | None = None,
    end_user: str | None = None,
) -> dict[str, Any]:
    """``{"rows": [...], "totals": {...}}`` over ``start``..``end`` (UTC days, both included).

    Grouped by end user (``user``) or filtered to one (``end_user``; "" is requests without one), it
    reads the raw rows; otherwise the daily rollups."""
    where, params = _filters(
        start=start, end=end, tenant_id=tenant_id, key_id=key_id, model=model, end_user=end_user
    )
    source = "usage_daily"
    if "user" in group_by or end_user is not None:
        source = BY_END_USER
        params["start_at"] = datetime.combine(start, time(0), tzinfo=UTC)
        params["end_at"] = datetime.combine(end + timedelta(days=1), time(0), tzinfo=UTC)
    columns = [f"d.{GROUP_FIELDS[g]}" for g in group_by]
    select_groups = "".join(f"{c}, " for c in columns)
    group_clause = f"GROUP BY {', '.join(columns)} ORDER BY {', '.join(columns)}" if columns else ""
    sql = f"""
        SELECT {select_groups}
               sum(d.requests) AS requests, sum(d.errors) AS errors,
               sum(d.prompt_tokens) AS prompt_tokens, sum(d.cached_tokens) AS cached_tokens,
               sum(d.completion_tokens) AS completion_tokens, sum(d.reasoning_tokens) AS reasoning_tokens,
               sum({COST_MICRO_SQL}) AS cost_micro
        FROM {source} d {PRICE_LATERAL}
        WHERE {where}
        {group_clause}
    """
    result = await session.execute(text(sql), params)
    rows: list[dict[str, Any]] = []
    for row in result:
        out: dict[str, Any] = {}
        for g in group_by:
            value = getattr(row, GROUP_FIELDS[g])
            if g == "user":
                out["end_user"] = value or None  # "" groups the requests without a user
            else:
                out[GROUP_FIELDS[g]] = value.isoformat() if isinstance(value, date) else str(value)
        out.update(_metrics(row))
        rows.append(out)
    totals: dict[str, Any] = {k: 0 for k in ("requests", "errors", "prompt_tokens", "cached_tokens")}
    totals.update({"completion_tokens": 0, "reasoning_tokens": 0, "total_tokens": 0, "cost": Decimal(0)})
    for summed in rows:
        for k in totals:
            totals[k] += summed[k]
    for item in [*rows, totals]:
        item["cost"] = money_str(item["cost"])
    return {"rows": rows, "totals": totals}


# ---------------------------------------------------------------- monthly bill


def parse_month(month: str) -> date:
    try:
        parsed = datetime.strptime(month, "%Y-%m")
    except ValueError:
        raise InvalidInput("month must look like 2026-11 (YYYY-MM).", param="month") from None
    return date(parsed.year, parsed.month, 1)


async def monthly_bill(session: AsyncSession, *, tenant_id: uuid.UUID, month: date) -> Bill:
    """One line per model and price in effect during the month."""
    sql = f"""
        SELECT d.model, p.effective_from, p.prompt_per_mtok, p.cached_prompt_per_mtok, p.completion_per_mtok,
               sum(d.requests) AS requests, sum(d.prompt_tokens) AS prompt_tokens,
               sum(d.cached_tokens) AS cached_tokens, sum(d.completion_tokens) AS completion_tokens,
               sum({COST_MICRO_SQL}) AS cost_micro
        FROM usage_daily d {PRICE_LATERAL}
        WHERE d.tenant_id = :tenant_id AND d.day >= :start AND d.day < :end
        GROUP BY d.model, p.id, p.effective_from, p.prompt_per_mtok, p.cached_prompt_per_mtok,
                 p.completion_per_mtok
        ORDER BY d.model, p.effective_from NULLS FIRST
    """
    params = {"tenant_id": tenant_id, "start": month, "end": add_months(month, 1)}
    lines, total_tokens, total_cost = [], 0, Decimal(0)
    for row in await session.execute(text(sql), params):
        cost = from_micro(row.cost_micro)
        priced = row.effective_from is not None
        lines.append(
            BillLine(
                model=row.model,
                price_effective_from=row.effective_from,
                prompt_per_mtok=money_str(row.prompt_per_mtok) if priced else None,
                cached_prompt_per_mtok=money_str(row.cached_prompt_per_mtok) if priced else None,
                completion_per_mtok=money_str(row.completion_per_mtok) if priced else None,
                requests=int(row.requests),
                prompt_tokens=int(row.prompt_tokens),
                cached_tokens=int(row.cached_tokens),
                completion_tokens=int(row.completion_tokens),
                cost=money_str(cost),
            )
        )
        total_tokens += int(row.prompt_tokens) + int(row.completion_tokens)
        total_cost += cost
    return Bill(
        tenant_id=str(tenant_id),
        month=month.strftime("%Y-%m"),
        lines=lines,
        total_tokens=total_tokens,
        total_cost=money_str(total_cost),
    )


# ---------------------------------------------------------------- budgets


async def period_usage(
    engine: AsyncEngine, *, column: str, owner_id: str, start: date, end: date | None
) -> tuple[int, Decimal]:
    """(tokens, cost) of a key (``column="key_id"``) or tenant (``"tenant_id"``) on the UTC days from
    ``start`` up to ``end`` (excluded; None: up to today and beyond)."""
    if column not in ("key_id", "tenant_id"):
        raise ValueError(column)
    until = "" if end is None else "AND d.day < :end"
    sql = f"""
        SELECT coalesce(sum(d.prompt_tokens + d.completion_tokens), 0) AS tokens,
               sum({COST_MICRO_SQL}) AS cost_micro
        FROM usage_daily d {PRICE_LATERAL}
        WHERE d.{column} = :owner AND d.day >= :start {until}
    """
    params: dict[str, Any] = {"owner": uuid.UUID(owner_id), "start": start}
    if end is not None:
        params["end"] = end
    async with engine.connect() as conn:
        row = (await conn.execute(text(sql), params)).one()
    return int(row.tokens), from_micro(row.cost_micro)
