"""The gateway's parts, built once per process, in one typed object: :class:`GatewayState`.

``create_app`` runs :func:`running_gateway` in its lifespan and stores the state as
``app.state.gateway``. A route reads it through a small Protocol of its own domain that names only
what it uses (``auth.deps.AuthState``, ``proxy.router.ProxyState``, ...), so no domain imports this
module, which imports them all. Shutdown (SIGTERM, after uvicorn let in-flight requests finish)
closes the parts in reverse: the usage buffer is flushed (or left in its journal if Postgres is down), then
the engine pool, Redis and the database.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import date
from decimal import Decimal

from fastapi import FastAPI
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from gateway.budgets.alerts import AlertSettings, BudgetAlerts, Owner, used_ratio
from gateway.config import Settings
from gateway.db import create_db_engine, create_sessionmaker
from gateway.keys.auth import KeyAuthenticator
from gateway.keys.service import bootstrap_admin_key
from gateway.limits.admission import RequestLimiter
from gateway.limits.config import LimitsSettings
from gateway.limits.limiter import RateLimiter
from gateway.limits.liveness import Liveness, new_instance_id
from gateway.limits.policies import LimitPolicies
from gateway.limits.recovery import LimitsRecovery
from gateway.limits.schemas import Scope
from gateway.proxy.engine_pool import EnginePool, ModelNames
from gateway.proxy.outcome import CompletionHook, UsageJournal
from gateway.proxy.prefix_routing import RoutingParams
from gateway.proxy.token_count import TokenCounter
from gateway.redis import create_redis
from gateway.reports import service as reports_service
from gateway.reports.pricing import PriceBook
from gateway.usage.config import UsageSettings
from gateway.usage.hook import UsageHook
from gateway.usage.ledger import LedgerRecovery
from gateway.usage.recorder import UsageRecorder

log = logging.getLogger("tern.gateway")

LIMITS_REDIS_CONNECTIONS = 64


@dataclass(slots=True)
class GatewayState:
    """Everything a request may need, alive from start-up to shutdown."""

    settings: Settings
    db_engine: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
    redis: Redis
    key_authenticator: KeyAuthenticator
    engine_pool: EnginePool
    usage_recorder: UsageRecorder
    limits_redis: Redis
    """A separate, fail-fast client: the limits must not wait on the shared one's retries."""
    request_limiter: RequestLimiter
    budget_alerts: BudgetAlerts
    """Audit rows and webhook calls when a budget crosses its alert threshold."""
    completion_hooks: list[CompletionHook] = field(default_factory=list)
    """Run with every finished /v1 request's outcome: limits settlement, then usage metering."""
    usage_journal: UsageJournal | None = None
    """Journals a complete answer's usage before its last bytes (usage metering)."""

    @property
    def admitter(self) -> RequestLimiter:
        """What the proxy asks before any engine work (``proxy.outcome.Admitter``)."""
        return self.request_limiter


def gateway_state(app: FastAPI) -> GatewayState:
    """The running app's state (for tests and tools; routes use their domain's view)."""
    return app.state.gateway


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


def _owner(scope: Scope) -> Owner:
    kind = scope.kind.split("_")[0]
    key_id = scope.id if kind == "key" else None
    return Owner(scope=scope.kind, scope_name=scope.name, tenant_id=scope.tenant_id, key_id=key_id)


def _request_limiter(
    *,
    db_engine: AsyncEngine,
    sessionmaker: async_sessionmaker[AsyncSession],
    limits_redis: Redis,
    limits_settings: LimitsSettings,
    instance_id: str,
    alerts: BudgetAlerts,
) -> RequestLimiter:
    async def load_usage(scope: Scope, start: date, end: date | None) -> tuple[int, Decimal]:
        column = "key_id" if scope.kind.startswith("key") else "tenant_id"
        return await reports_service.period_usage(
            db_engine, column=column, owner_id=scope.id, start=start, end=end
        )

    return RequestLimiter(
        limiter=RateLimiter(
            redis=limits_redis,
            settings=limits_settings,
            load_usage=load_usage,
            instance_id=instance_id,
            on_alert=lambda scope, rule, used, day: alerts(_owner(scope), rule, used, day),
            on_used=used_ratio,
        ),
        policies=LimitPolicies(sessionmaker=sessionmaker, settings=limits_settings),
        prices=PriceBook(engine=db_engine),
    )


def _engine_pool(settings: Settings) -> EnginePool:
    """The engines as configured; warns when tenants would share an 'openai' engine's prefix cache."""
    if settings.prefix_cache_isolation == "tenant" and not settings.engine_cache_salt:
        if any(spec.kind == "openai" for spec in settings.engine_specs()):
            log.warning(
                "TERN_ENGINE_CACHE_SALT=false: the prefix caches of 'openai' engines are shared "
                "by every tenant (the gateway cannot isolate them)"
            )
    return EnginePool(
        settings.engine_specs(),
        health_interval_s=settings.engine_health_interval_s,
        connect_timeout_s=settings.engine_connect_timeout_s,
        request_timeout_s=settings.engine_request_timeout_s,
        api_key=settings.engine_api_key.get_secret_value() if settings.engine_api_key else None,
        model_names=ModelNames(settings.engine_model_map),
        token_counter=TokenCounter(settings.engine_tokenizers),
        routing=settings.routing_policy,
        sends_cache_salt=settings.engine_cache_salt,
        routing_params=RoutingParams(
            load_slack=settings.routing_load_slack, min_match=settings.routing_min_match
        ),
    )


@asynccontextmanager
async def running_gateway(settings: Settings) -> AsyncIterator[GatewayState]:
    """Start every part (registering ``TERN_ADMIN_KEY`` if set), yield them, close them in reverse."""
    async with AsyncExitStack() as stack:
        db_engine = create_db_engine(settings)
        stack.push_async_callback(db_engine.dispose)
        sessionmaker = create_sessionmaker(db_engine)
        redis = create_redis(settings.redis_url)
        stack.push_async_callback(redis.aclose)
        secret = settings.secret_bytes()
        if settings.admin_key is not None:
            added = await bootstrap_admin_key(
                sessionmaker, admin_key=settings.admin_key.get_secret_value(), secret=secret
            )
            if added:
                log.info("registered TERN_ADMIN_KEY as a platform admin key")
        limits_redis = create_limits_redis(settings.redis_url)
        stack.push_async_callback(limits_redis.aclose)
        # One id per process: its journal segments and its concurrency slots carry it, so a
        # successor knows what a dead process held (usage/journal.py, limits/liveness.py).
        instance_id = new_instance_id()
        limits_settings = LimitsSettings()
        liveness = Liveness(redis, instance_id=instance_id, ttl_s=limits_settings.liveness_ttl_s)
        await liveness.start()
        stack.push_async_callback(liveness.stop)
        engine_pool = _engine_pool(settings)
        await engine_pool.start()
        stack.push_async_callback(engine_pool.close)
        usage_recorder = UsageRecorder(engine=db_engine, settings=UsageSettings(), instance_id=instance_id)
        ledger_recovery = LedgerRecovery(pool=engine_pool, recorder=usage_recorder)
        stack.push_async_callback(ledger_recovery.close)
        # After a crash: bill the dead process's journal, then its cut streams; free what it held.
        usage_recorder.on_recovered += [LimitsRecovery(redis=redis, liveness=liveness), ledger_recovery]
        await usage_recorder.start()
        stack.push_async_callback(usage_recorder.stop)  # flush what was metered (or leave it journaled)
        budget_alerts = BudgetAlerts(sessionmaker=sessionmaker, settings=AlertSettings())
        request_limiter = _request_limiter(
            db_engine=db_engine,
            sessionmaker=sessionmaker,
            limits_redis=limits_redis,
            limits_settings=limits_settings,
            instance_id=instance_id,
            alerts=budget_alerts,
        )
        stack.push_async_callback(request_limiter.limiter.drain_alerts)  # alerts on their way finish
        usage_hook = UsageHook(usage_recorder)
        yield GatewayState(
            settings=settings,
            db_engine=db_engine,
            sessionmaker=sessionmaker,
            redis=redis,
            key_authenticator=KeyAuthenticator(
                sessionmaker=sessionmaker,
                secret=secret,
                cache_ttl_s=settings.key_cache_ttl_s,
                last_used_interval_s=settings.key_last_used_interval_s,
            ),
            engine_pool=engine_pool,
            usage_recorder=usage_recorder,
            limits_redis=limits_redis,
            request_limiter=request_limiter,
            budget_alerts=budget_alerts,
            completion_hooks=[request_limiter.on_complete, usage_hook],
            usage_journal=usage_hook,
        )
