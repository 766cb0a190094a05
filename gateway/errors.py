"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the gateway returns to a client goes through :class:`OpenAIError`,
so status codes and bodies stay consistent across domains.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import ORJSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "insufficient_quota",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_body(
    message: str, *, status: int, param: str | None = None, code: str | None = None, type: str | None = None
) -> dict[str, Any]:
    err_type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers or {}

    def response(self) -> ORJSONResponse:
        body = error_body(self.message, status=self.status, param=self.param, code=self.code, type=self.type)
        return ORJSONResponse(body, status_code=self.status, headers=self.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "Request body is not valid JSON.", None
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    msg = first.get("msg", "Invalid request.")
    return (f"{param}: {msg}" if param else msg), param


def install_error_handlers(app: FastAPI) -> None:
    """Make FastAPI's own errors (validation, 404, 405) OpenAI-shaped too."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> ORJSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> ORJSONResponse:
        message, param = _validation_message(exc)
        return ORJSONResponse(error_body(message, status=400, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> ORJSONResponse:
        return ORJSONResponse(
            error_body(str(exc.detail), status=exc.status_code),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )
