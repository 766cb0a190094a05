"""Wires limits, usage metering and reports into the app: routers, start-up and drain.

``start`` runs in the app's lifespan after the database and engine pool exist; ``stop`` runs at
shutdown (so on SIGTERM, after uvicorn has let in-flight requests finish): pending settlements
are awaited and the usage buffer is flushed, or spooled to disk if Postgres is down.
"""

from __future__ import annotations

from datetime import date
from decimal import Decimal

from fastapi import FastAPI
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from gateway.config import Settings
from gateway.limits.admission import RequestLimiter
from gateway.limits.config import LimitsSettings
from gateway.limits.policies import LimitPolicies
from gateway.limits.router import router as limits_router
from gateway.limits.schemas import Scope
from gateway.limits.service import RateLimiter
from gateway.reports import service as reports_service
from gateway.reports.pricing import PriceBook
from gateway.reports.router import admin_router as reports_admin_router
from gateway.reports.router import public_router as usage_public_router
from gateway.usage.config import UsageSettings
from gateway.usage.hook import UsageHook
from gateway.usage.recorder import UsageRecorder

LIMITS_REDIS_CONNECTIONS = 64


def include_routers(app: FastAPI) -> None:
    app.include_router(limits_router)
    app.include_router(reports_admin_router)
    app.include_router(usage_public_router)


def create_limits_redis(url: str) -> Redis:
    """A client that fails fast (no retries, short timeouts): while Redis is away, the failure
    policies take over within seconds instead of after a retry backoff."""
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=LIMITS_REDIS_CONNECTIONS,
        timeout=5.0,  # a burst waits for a free connection instead of failing as "Redis down"
        socket_connect_timeout=2.0,
        socket_timeout=2.0,
    )
    return Redis(connection_pool=pool, retry=Retry(NoBackoff(), 0))


async def start(app: FastAPI) -> None:
    settings: Settings = app.state.settings
    usage_settings: UsageSettings = getattr(app.state, "usage_settings", None) or UsageSettings()
    limits_settings: LimitsSettings = getattr(app.state, "limits_settings", None) or LimitsSettings()
    db_engine = app.state.db_engine

    recorder = UsageRecorder(engine=db_engine, settings=usage_settings)
    await recorder.start()

    async def load_month_usage(scope: Scope, month: date) -> tuple[int, Decimal]:
        column = "key_id" if scope.kind.startswith("key") else "tenant_id"
        return await reports_service.month_usage(db_engine, column=column, owner_id=scope.id, month=month)

    limits_redis = create_limits_redis(settings.redis_url)
    request_limiter = RequestLimiter(
        limiter=RateLimiter(redis=limits_redis, settings=limits_settings, load_month_usage=load_month_usage),
        policies=LimitPolicies(sessionmaker=app.state.sessionmaker, settings=limits_settings),
        prices=PriceBook(engine=db_engine),
    )
    app.state.usage_recorder = recorder
    app.state.limits_redis = limits_redis
    app.state.request_limiter = request_limiter
    app.state.completion_hooks.extend([request_limiter.on_complete, UsageHook(recorder)])


async def stop(app: FastAPI) -> None:
    request_limiter: RequestLimiter | None = getattr(app.state, "request_limiter", None)
    if request_limiter is not None:
        await request_limiter.drain()
        await app.state.limits_redis.aclose()
    recorder: UsageRecorder | None = getattr(app.state, "usage_recorder", None)
    if recorder is not None:
        await recorder.stop()
