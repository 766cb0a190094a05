"""The per-request envelope: request id, body-size limit, access log, metrics, last-resort 500.

A plain ASGI middleware (not ``BaseHTTPMiddleware``) so streamed responses pass through chunk by
chunk and client disconnects still reach the endpoint.
"""

from __future__ import annotations

import logging
import os
import re
import time

from fastapi import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import OpenAIError
from gateway.logging import request_id_var
from gateway.metrics import request_latency_by, requests_by

access_log = logging.getLogger("tern.access")
error_log = logging.getLogger("tern.error")

REQUEST_ID_HEADER = b"x-request-id"
CLIENT_CLOSED_REQUEST = 499
"""nginx's status for a client that closed its connection before the answer: logged, never sent."""
_SANE_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:\-]{1,128}")


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


def _client_request_id(scope: Scope) -> str | None:
    """The caller's own ``x-request-id`` when it is short and harmless: logged, never used as a key."""
    incoming = _header(scope, REQUEST_ID_HEADER)
    if incoming is not None and _SANE_REQUEST_ID.fullmatch(incoming):
        return incoming.decode()
    return None


def _route_template(scope: Scope) -> str:
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"


def _too_large(limit: int) -> str:
    return f"Request body too large: the limit is {limit} bytes."


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # Always the gateway's own id: it keys the engine RPC, the limits and the usage row, so a
        # caller must not be able to choose it (two requests sharing one would collide).
        request_id = os.urandom(16).hex()  # 128 random bits as uuid4().hex, without the UUID object
        scope.setdefault("state", {})["request_id"] = request_id
        token = request_id_var.set(request_id)
        started = time.perf_counter()
        status = 500
        response_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                status = message["status"]
                response_started = True
                message["headers"] = [*message.get("headers", []), (REQUEST_ID_HEADER, request_id.encode())]
            await send(message)

        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # FastAPI re-raises HTTPException from body reading; errors.py shapes it.
                    raise HTTPException(413, _too_large(self.max_body_bytes))
            return message

        try:
            declared = _header(scope, b"content-length")
            if declared is not None and declared.isdigit():
                if int(declared) > self.max_body_bytes:
                    error = OpenAIError(413, _too_large(self.max_body_bytes))
                    await error.response()(scope, receive, send_with_id)
                else:  # the HTTP server never delivers more than the declared length
                    await self.app(scope, receive, send_with_id)
            else:  # chunked: count while reading
                await self.app(scope, limited_receive, send_with_id)
        except ClientDisconnect:
            # The client went away before its request body arrived: no one is left to answer, and
            # nothing reached an engine or a meter. nginx's 499 says so in the log and the metrics.
            if not response_started:
                status = CLIENT_CLOSED_REQUEST
        except Exception:
            error_log.exception("unhandled error")
            if not response_started:
                error = OpenAIError(500, "Internal server error.", type="server_error")
                await error.response()(scope, receive, send_with_id)
        finally:
            if not response_started and scope["state"].get("client_disconnected"):
                status = CLIENT_CLOSED_REQUEST  # it left while we worked on the answer (a timeout, say)
            elapsed = time.perf_counter() - started
            route = _route_template(scope)
            method = scope["method"]
            requests_by(method, route, str(status)).inc()
            request_latency_by(method, route).observe(elapsed)
            if access_log.isEnabledFor(logging.INFO):
                state = scope.get("state", {})
                access_log.info(
                    "request",
                    extra={
                        "request_id": request_id,
                        "client_request_id": _client_request_id(scope),
                        "method": method,
                        "path": scope["path"],
                        "route": route,
                        "status": status,
                        "duration_ms": round(elapsed * 1000, 2),
                        "key_id": state.get("key_id"),
                        "tenant_id": state.get("tenant_id"),
                    },
                )
            request_id_var.reset(token)
