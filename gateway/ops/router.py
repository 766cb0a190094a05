"""``/healthz`` (the process is up), ``/readyz`` (it can serve) and ``/metrics`` (Prometheus)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from redis.asyncio import Redis
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.errors import error_body
from gateway.metrics import exposition
from gateway.proxy.engine_pool import EnginePool

router = APIRouter(tags=["ops"])
log = logging.getLogger(__name__)

READY_CHECK_TIMEOUT_S = 2.0


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


class OpsState(Protocol):
    """What readiness checks read from the app's state (``gateway.wiring.GatewayState``)."""

    db_engine: AsyncEngine
    redis: Redis
    engine_pool: EnginePool


def _state(request: Request) -> OpsState:
    return request.app.state.gateway


async def _database_ok(request: Request) -> bool:
    async with _state(request).db_engine.connect() as conn:
        await conn.execute(text("SELECT 1"))
    return True


async def _redis_ok(request: Request) -> bool:
    return bool(await _state(request).redis.ping())


async def _engine_ok(request: Request) -> bool:
    return bool(await _state(request).engine_pool.any_healthy())


async def _check(name: str, probe: Callable[[Request], Awaitable[bool]], request: Request) -> bool:
    try:
        return await asyncio.wait_for(probe(request), READY_CHECK_TIMEOUT_S)
    except Exception as exc:
        log.warning("readiness check failed", extra={"check": name, "error": repr(exc)})
        return False


@router.get("/readyz", responses={503: {"description": "Not ready: the checks say which part is down"}})
async def readyz(request: Request) -> JSONResponse:
    """200 only when the database, Redis and at least one engine all answer."""
    probes = {"database": _database_ok, "redis": _redis_ok, "engine": _engine_ok}
    results = await asyncio.gather(*(_check(name, probe, request) for name, probe in probes.items()))
    checks = dict(zip(probes, results, strict=True))
    if all(results):
        return JSONResponse({"status": "ready", "checks": checks})
    failing = ", ".join(name for name, ok in checks.items() if not ok)
    body = error_body(f"Not ready: {failing} unavailable.", status=503, code="not_ready")
    return JSONResponse({**body, "checks": checks}, status_code=503)


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}},
)
async def metrics() -> Response:
    return Response(exposition(), media_type=CONTENT_TYPE_LATEST)
