"""Creating, deleting and reading budgets, and where each stands in its current period.

Only platform admins change budgets; tenant admins read their own tenant's. Every change is audited.
Where a budget stands is read from the admission counters in Redis (settled usage and the worst
cases held by requests in flight); a counter Redis does not hold is summed from ``usage_daily``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, date, datetime, time
from decimal import Decimal

from redis.asyncio import Redis
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from gateway import keyspace
from gateway.audit.service import record
from gateway.auth.identity import Actor
from gateway.budgets.exceptions import BudgetExists, BudgetNotFound, KeyOfAnotherTenant
from gateway.budgets.models import BudgetRow
from gateway.budgets.periods import period_end, period_id, period_start, resets_at
from gateway.budgets.rules import BudgetRule, Metric, from_nano, to_nano
from gateway.budgets.schemas import BudgetCreate, BudgetStatus
from gateway.exceptions import PlatformAdminRequired
from gateway.keys.service import get_key
from gateway.reports.service import period_usage
from gateway.tenants.service import get_tenant


def _audit_view(row: BudgetRow) -> dict[str, object]:
    return {
        "id": row.id,
        "tenant_id": str(row.tenant_id),
        "key_id": None if row.key_id is None else str(row.key_id),
        "metric": row.metric,
        "period": row.period,
        "amount": str(row.amount),
        "alert_ratio": None if row.alert_ratio is None else str(row.alert_ratio),
    }


async def create_budget(session: AsyncSession, *, actor: Actor, body: BudgetCreate) -> BudgetRow:
    if not actor.is_platform:
        raise PlatformAdminRequired("change budgets")
    await get_tenant(session, actor=actor, tenant_id=body.tenant_id)
    if body.key_id is not None:
        key = await get_key(session, actor=actor, key_id=body.key_id)
        if key.tenant_id != body.tenant_id:
            raise KeyOfAnotherTenant()
    amount = Decimal(body.amount).to_integral_value() if body.metric == "tokens" else body.amount
    ratio = None if body.alert_ratio is None else Decimal(str(round(body.alert_ratio, 3)))
    if ratio is not None and ratio == 0:
        ratio = Decimal("0.001")
    row = BudgetRow(**{**body.model_dump(), "amount": amount, "alert_ratio": ratio})
    session.add(row)
    try:
        await session.flush()
    except IntegrityError as exc:
        await session.rollback()
        raise BudgetExists(body.metric, body.period) from exc
    record(
        session,
        actor=actor,
        tenant_id=row.tenant_id,
        action="budget.create",
        object_type="budget",
        object_id=str(row.id),
        before=None,
        after=_audit_view(row),
    )
    await session.commit()
    return row


async def delete_budget(session: AsyncSession, *, actor: Actor, budget_id: int) -> BudgetRow:
    if not actor.is_platform:
        raise PlatformAdminRequired("change budgets")
    row = await session.get(BudgetRow, budget_id)
    if row is None:
        raise BudgetNotFound(budget_id)
    before = _audit_view(row)
    await session.delete(row)
    record(
        session,
        actor=actor,
        tenant_id=row.tenant_id,
        action="budget.delete",
        object_type="budget",
        object_id=str(budget_id),
        before=before,
        after=None,
    )
    await session.commit()
    return row


@dataclass(frozen=True, slots=True)
class _Owned:
    """A budget with its owner: a ``budgets`` row, or a ``monthly_*_budget`` field (``id`` None)."""

    id: int | None
    tenant_id: uuid.UUID
    key_id: uuid.UUID | None
    rule: BudgetRule
    alert_ratio: Decimal | None

    @property
    def scope_name(self) -> str:
        return _scope_name(self.tenant_id, self.key_id)


def _scope_name(tenant_id: uuid.UUID, key_id: uuid.UUID | None) -> str:
    """``gateway.limits.schemas.Scope.name`` of the key or tenant scope."""
    return keyspace.scope_name("tenant", tenant_id) if key_id is None else keyspace.scope_name("key", key_id)


MONTHLY_FIELDS_SQL = """
    SELECT NULL::uuid AS key_id, monthly_token_budget AS tokens, monthly_spend_budget AS spend
    FROM tenant_limits WHERE tenant_id = :tenant
    UNION ALL
    SELECT k.id, k.monthly_token_budget, l.monthly_spend_budget
    FROM api_keys k LEFT JOIN key_limits l ON l.key_id = k.id
    WHERE k.tenant_id = :tenant AND k.revoked_at IS NULL
"""
"""The monthly budgets set as fields of a tenant's limits and of its keys (read here without the
limits domain's models, which import this domain)."""


async def _budgets_of(session: AsyncSession, tenant_id: uuid.UUID, key_id: uuid.UUID | None) -> list[_Owned]:
    query = select(BudgetRow).where(BudgetRow.tenant_id == tenant_id).order_by(BudgetRow.id)
    owned = [
        _Owned(
            row.id,
            row.tenant_id,
            row.key_id,
            BudgetRule.of(metric=row.metric, period=row.period, amount=row.amount),  # type: ignore[arg-type]
            row.alert_ratio,
        )
        for row in await session.scalars(query)
    ]
    for row in await session.execute(text(MONTHLY_FIELDS_SQL), {"tenant": tenant_id}):
        for metric, amount in (("tokens", row.tokens), ("spend", row.spend)):
            if amount is not None:
                rule = BudgetRule.of(metric=metric, period="month", amount=amount)  # type: ignore[arg-type]
                owned.append(_Owned(None, tenant_id, row.key_id, rule, None))
    if key_id is not None:
        owned = [o for o in owned if o.key_id == key_id]
    return owned


async def drop_unkept_counter(
    session: AsyncSession, redis: Redis, row: BudgetRow, *, day: date | None = None
) -> None:
    """Drop the current period's counter of ``row``'s scope when no other budget of that scope counts in
    the same period. settle.lua adds to a counter only while some budget uses it, so once a scope's
    last budget of a period is deleted its counter stops seeing usage; a budget created later in the
    same period would then start from that stale count and could be overspent. Without the counter,
    admission (and GET /admin/budgets) sums the period again from the usage rows in Postgres."""
    others = [
        owned
        for owned in await _budgets_of(session, row.tenant_id, row.key_id)
        if owned.key_id == row.key_id and owned.rule.period == row.period and owned.id != row.id
    ]
    if not others:
        day = day or datetime.now(UTC).date()
        scope = _scope_name(row.tenant_id, row.key_id)
        await redis.delete(keyspace.counter_key(scope, period_id(row.period, day)))  # type: ignore[arg-type]


def _amount(metric: Metric, value: int) -> str:
    return str(value) if metric == "tokens" else format(from_nano(value), "f")


async def budget_statuses(
    session: AsyncSession,
    *,
    actor: Actor,
    redis: Redis,
    db_engine: AsyncEngine,
    tenant_id: uuid.UUID,
    key_id: uuid.UUID | None = None,
    day: date | None = None,
) -> list[BudgetStatus]:
    await get_tenant(session, actor=actor, tenant_id=tenant_id)
    day = day or datetime.now(UTC).date()
    out = []
    for owned in await _budgets_of(session, tenant_id, key_id):
        rule, period = owned.rule, owned.rule.period
        counter_key = keyspace.counter_key(owned.scope_name, period_id(period, day))
        counter = await redis.hmget(counter_key, keyspace.COUNTER_FIELDS)
        if counter[0] is None:
            column, owner = ("key_id", owned.key_id) if owned.key_id else ("tenant_id", owned.tenant_id)
            tokens, spend = await period_usage(
                db_engine,
                column=column,
                owner_id=str(owner),
                start=period_start(period, day),
                end=period_end(period, day),
            )
            used = tokens if rule.metric == "tokens" else to_nano(spend)
        else:
            used = int(counter[0] if rule.metric == "tokens" else counter[1] or 0)
        held = await redis.hmget(keyspace.reservation_keys(owned.scope_name)[0], keyspace.HELD_FIELDS)
        reserved = int(held[0 if rule.metric == "tokens" else 1] or 0)
        out.append(
            BudgetStatus(
                id=owned.id,
                tenant_id=owned.tenant_id,
                key_id=owned.key_id,
                metric=rule.metric,
                period=period,
                limit=_amount(rule.metric, rule.limit),
                used=_amount(rule.metric, used),
                reserved=_amount(rule.metric, reserved),
                used_ratio=used / rule.limit if rule.limit else 1.0,
                alert_ratio=None if owned.alert_ratio is None else float(owned.alert_ratio),
                period_start=datetime.combine(period_start(period, day), time(0), tzinfo=UTC),
                resets_at=resets_at(period, day),
            )
        )
    return out
