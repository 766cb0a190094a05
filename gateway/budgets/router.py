"""``/admin/budgets``: token and spend budgets per key or tenant, with periods, and where they stand."""

from __future__ import annotations

import uuid
from typing import Protocol

from fastapi import APIRouter, Request, Response
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.auth.deps import AdminActor
from gateway.bounds import RowId
from gateway.budgets import service
from gateway.budgets.schemas import BudgetCreate, BudgetList, BudgetStatus
from gateway.db import DbSession

router = APIRouter(prefix="/admin/budgets", tags=["admin: budgets"])


class _Policies(Protocol):
    def forget(self, key_id: uuid.UUID | None = None) -> None: ...


class _Limiter(Protocol):
    @property
    def policies(self) -> _Policies: ...


class BudgetsState(Protocol):
    """What the budget routes read from the app's state (``gateway.wiring.GatewayState``)."""

    @property
    def limits_redis(self) -> Redis: ...
    @property
    def db_engine(self) -> AsyncEngine: ...
    @property
    def request_limiter(self) -> _Limiter: ...


def _state(request: Request) -> BudgetsState:
    state: BudgetsState = request.app.state.gateway
    return state


async def _statuses(
    request: Request, session: DbSession, actor: AdminActor, tenant: uuid.UUID, key: uuid.UUID | None
) -> list[BudgetStatus]:
    state = _state(request)
    return await service.budget_statuses(
        session,
        actor=actor,
        redis=state.limits_redis,
        db_engine=state.db_engine,
        tenant_id=tenant,
        key_id=key,
    )


@router.get("")
async def list_budgets(
    request: Request, actor: AdminActor, session: DbSession, tenant: uuid.UUID, key: uuid.UUID | None = None
) -> BudgetList:
    """Every budget of a tenant (and of its keys; ``key=`` for one key's) with what it has used and
    holds for requests in flight in its current period, and when that period resets."""
    return BudgetList(data=await _statuses(request, session, actor, tenant, key))


@router.post("", status_code=201)
async def create_budget(
    request: Request, body: BudgetCreate, actor: AdminActor, session: DbSession
) -> BudgetStatus:
    row = await service.create_budget(session, actor=actor, body=body)
    await service.drop_unkept_counter(session, _state(request).limits_redis, row)
    _state(request).request_limiter.policies.forget()  # this process at once, others within the cache TTL
    statuses = await _statuses(request, session, actor, row.tenant_id, row.key_id)
    return next(s for s in statuses if s.id == row.id)


@router.delete("/{budget_id}", status_code=204)
async def delete_budget(
    request: Request, budget_id: RowId, actor: AdminActor, session: DbSession
) -> Response:
    row = await service.delete_budget(session, actor=actor, budget_id=budget_id)
    await service.drop_unkept_counter(session, _state(request).limits_redis, row)
    _state(request).request_limiter.policies.forget()
    return Response(status_code=204)
