"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the gateway returns to a client goes through :class:`OpenAIError`,
so status codes and bodies stay consistent across domains.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import ORJSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.openai_protocol import describe_validation_errors, error_body


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
    return describe_validation_errors(list(exc.errors()))


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
