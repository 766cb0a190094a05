"""Which scopes limit a request: the key (``api_keys`` columns plus ``key_limits``), its tenant
(``tenant_limits``) and, where configured, either of them for the requested model.

Rows are cached in process for ``config_cache_s``; while Postgres is unreachable the last rows seen
keep applying, so an outage never turns limits off.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from functools import partial
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.auth.identity import AuthenticatedKey
from gateway.budgets.models import BudgetRow
from gateway.budgets.rules import BudgetRule
from gateway.limits.config import FailurePolicy, LimitsSettings
from gateway.limits.models import KeyLimits, TenantLimits
from gateway.limits.schemas import ModelLimit, RequestLimits, Scope
from gateway.ttl_cache import TtlCache

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Rows:
    tenant: TenantLimits | None
    key: KeyLimits | None
    key_budgets: tuple[BudgetRule, ...] = ()
    tenant_budgets: tuple[BudgetRule, ...] = ()
    built: dict[tuple[AuthenticatedKey, str], RequestLimits] = field(default_factory=dict, compare=False)
    """``for_request`` results from these rows, per key state and model (dropped with the rows)."""


def _model_scope(
    kind: str, owner: str, label: str, model: str, model_limits: dict[str, Any], tenant_id: str | None
) -> Scope | None:
    stored = model_limits.get(model)
    if not stored:
        return None
    limits = ModelLimit.model_validate(stored)  # rows written under the old names read the same
    return Scope(
        kind=f"{kind}_model",  # type: ignore[arg-type]
        id=owner,
        label=f"{label} on model '{model}'",
        model=model,
        rpm=limits.rpm_limit,
        tpm=limits.tpm_limit,
        concurrency=limits.max_concurrency,
        tenant_id=tenant_id,
    )


def _rule(row: BudgetRow) -> BudgetRule:
    return BudgetRule.of(
        metric=row.metric,  # type: ignore[arg-type]  # checked by the table's constraint
        period=row.period,  # type: ignore[arg-type]
        amount=row.amount,
        alert_ratio=row.alert_ratio,
        budget_id=row.id,
    )


def _monthly(tokens: int | None, spend: Decimal | None) -> tuple[BudgetRule, ...]:
    """The ``monthly_*_budget`` fields, as the month budgets they always were."""
    rules = []
    if tokens is not None:
        rules.append(BudgetRule.of(metric="tokens", period="month", amount=tokens))
    if spend is not None:
        rules.append(BudgetRule.of(metric="spend", period="month", amount=spend))
    return tuple(rules)


class LimitPolicies:
    def __init__(self, *, sessionmaker: async_sessionmaker[AsyncSession], settings: LimitsSettings) -> None:
        self.sessionmaker = sessionmaker
        self.settings = settings
        self._cache: TtlCache[uuid.UUID, _Rows] = TtlCache(ttl_s=settings.config_cache_s)

    def forget(self, key_id: uuid.UUID | None = None) -> None:
        """Drop cached rows (after an admin change in this process)."""
        self._cache.forget(key_id)

    async def _rows(self, key: AuthenticatedKey) -> _Rows:
        try:
            return await self._cache.get(key.key_id, partial(self._load, key))
        except Exception as exc:
            stale = self._cache.stale(key.key_id)
            if stale is not None:
                return stale
            log.warning("cannot load limit settings for key %s, using the key's own: %s", key.key_id, exc)
            return _Rows(None, None)

    async def _load(self, key: AuthenticatedKey) -> _Rows:
        async with self.sessionmaker() as session:
            key_row = await session.scalar(select(KeyLimits).where(KeyLimits.key_id == key.key_id))
            tenant_row = None
            budget_rows: list[BudgetRow] = []
            if key.tenant_id is not None:
                tenant_row = await session.scalar(
                    select(TenantLimits).where(TenantLimits.tenant_id == key.tenant_id)
                )
                mine = BudgetRow.key_id == key.key_id
                tenants = BudgetRow.key_id.is_(None) & (BudgetRow.tenant_id == key.tenant_id)
                budget_rows = list(await session.scalars(select(BudgetRow).where(mine | tenants)))
        return _Rows(
            tenant_row,
            key_row,
            key_budgets=tuple(_rule(b) for b in budget_rows if b.key_id is not None),
            tenant_budgets=tuple(_rule(b) for b in budget_rows if b.key_id is None),
        )

    async def for_request(self, *, key: AuthenticatedKey, model: str) -> RequestLimits:
        rows = await self._rows(key)
        built = rows.built.get((key, model))
        if built is None:
            if len(rows.built) > 1000:  # a key used with many (possibly bogus) model names
                rows.built.clear()
            built = rows.built[(key, model)] = self._build(rows, key=key, model=model)
        return built

    def _build(self, rows: _Rows, *, key: AuthenticatedKey, model: str) -> RequestLimits:
        key_label = f"API key '{key.name}'"
        key_id = str(key.key_id)
        tenant = None if key.tenant_id is None else str(key.tenant_id)
        scopes: list[Scope | None] = [
            Scope(
                kind="key",
                id=key_id,
                label=key_label,
                rpm=key.rpm_limit,
                tpm=key.tpm_limit,
                concurrency=key.max_concurrency,
                budgets=(
                    *_monthly(key.monthly_token_budget, rows.key.monthly_spend_budget if rows.key else None),
                    *rows.key_budgets,
                ),
                tenant_id=tenant,
            )
        ]
        if rows.key is not None:
            scopes.append(_model_scope("key", key_id, key_label, model, rows.key.model_limits, tenant))
        if key.tenant_id is not None and (rows.tenant is not None or rows.tenant_budgets):
            t = rows.tenant
            tenant_id = str(key.tenant_id)
            scopes.append(
                Scope(
                    kind="tenant",
                    id=tenant_id,
                    label="this tenant",
                    rpm=t.rpm_limit if t else None,
                    tpm=t.tpm_limit if t else None,
                    concurrency=t.max_concurrency if t else None,
                    budgets=(
                        *(_monthly(t.monthly_token_budget, t.monthly_spend_budget) if t else ()),
                        *rows.tenant_budgets,
                    ),
                    tenant_id=tenant_id,
                )
            )
            if t is not None:
                scopes.append(_model_scope("tenant", tenant_id, "this tenant", model, t.model_limits, tenant))
        policy: FailurePolicy = self.settings.failure_policy
        if rows.key is not None and rows.key.failure_policy in ("closed", "open"):
            policy = rows.key.failure_policy  # type: ignore[assignment]
        max_tokens = next(
            (row.max_tokens for row in (rows.key, rows.tenant) if row is not None and row.max_tokens),
            None,
        )
        return RequestLimits(
            scopes=tuple(s for s in scopes if s is not None and s.is_limited),
            failure_policy=policy,
            max_tokens=max_tokens,
        )
