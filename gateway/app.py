"""The gateway application: ``create_app(settings)`` puts routes and middleware together; the
parts they use are built by ``gateway.wiring`` in the lifespan.

Run it with ``tern gateway`` (uvicorn factory mode, settings from the environment).
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.audit.router import router as audit_router
from gateway.budgets.router import router as budgets_router
from gateway.config import Settings
from gateway.console.router import include_console
from gateway.engines.router import router as engines_router
from gateway.errors import install_error_handlers
from gateway.keys.router import router as keys_router
from gateway.limits.router import router as limits_router
from gateway.logging import configure_logging
from gateway.openapi import install_openapi
from gateway.ops.middleware import RequestContextMiddleware
from gateway.ops.router import router as ops_router
from gateway.proxy.router import generate_routes
from gateway.proxy.router import router as proxy_router
from gateway.reports.router import admin_router as reports_admin_router
from gateway.reports.router import public_router as usage_public_router
from gateway.tenants.router import router as tenants_router
from gateway.wiring import running_gateway


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with running_gateway(app.state.settings) as state:
        app.state.gateway = state
        # Everything loaded so far lives as long as the process: keep it out of the cyclic
        # garbage collector's full passes, which would otherwise walk it all again and
        # again (pauses that show as latency outliers).
        gc.freeze()
        yield


class GatewayApp(FastAPI):
    """FastAPI plus a direct lane for the hot routes.

    A POST to a direct route's path skips FastAPI's middleware stack, routing and dependency
    solving, which cost more CPU than everything else a proxied request does: it goes through the
    request envelope (request id, body limit, metrics, access log) straight to the route's plain
    ASGI endpoint, which authenticates and validates by itself. Every other request, including
    other methods on those paths (405), takes the ordinary way, where the route is registered too.
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.direct_posts: dict[str, tuple[Route, ASGIApp]] = {}

    def add_direct_route(self, route: Route, app: ASGIApp) -> None:
        """Serve POSTs to ``route.path`` with ``app`` (the route's endpoint in its envelope)."""
        self.router.routes.append(route)
        self.direct_posts[route.path] = (route, app)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.direct_posts:
            route, app = self.direct_posts[scope["path"]]
            scope["app"] = self
            scope["route"] = route  # labels the metrics and the access log, as FastAPI's routing does
            await app(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def create_app(settings: Settings | None = None) -> GatewayApp:
    settings = settings or Settings()
    configure_logging(settings.log_level, json=settings.log_json)
    app = GatewayApp(
        title="Tern gateway",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        # The gateway exports its own Prometheus metrics and JSON logs; FastAPI's native
        # OpenTelemetry hooks would only add per-request work.
        telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
    )
    app.state.settings = settings
    install_error_handlers(app)
    app.add_middleware(RequestContextMiddleware, max_body_bytes=settings.max_body_bytes)

    # The hot path: the /v1 generation routes, first, on the direct lane, in the same envelope.
    for route in generate_routes:
        app.add_direct_route(
            route, RequestContextMiddleware(route.app, max_body_bytes=settings.max_body_bytes)
        )
    app.include_router(proxy_router)
    app.include_router(ops_router)
    app.include_router(tenants_router)
    app.include_router(keys_router)
    app.include_router(audit_router)
    app.include_router(engines_router)
    app.include_router(limits_router)
    app.include_router(budgets_router)
    app.include_router(reports_admin_router)  # /admin/prices, /admin/reports
    app.include_router(usage_public_router)  # /v1/usage
    include_console(app)  # /ui/ (and / redirecting there)
    install_openapi(app)  # /openapi.json, complete: the direct-lane routes too
    return app
