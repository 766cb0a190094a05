"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the gateway returns to a client goes through :class:`OpenAIError` or is a domain
service's refusal (``gateway.exceptions``) mapped to its status here, so status codes and bodies
stay consistent across domains.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from sqlalchemy.exc import DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from gateway.exceptions import Conflict, DomainError, Forbidden, InvalidInput, NotFound
from protocol.openai.errors import OpenAIRequestError, describe_validation_errors, error_body

log = logging.getLogger(__name__)

DATA_EXCEPTION_CLASS = "22"
"""SQLSTATE class 22, data exception: numeric value out of range, untranslatable character, ..."""

DOMAIN_ERROR_STATUS: dict[type[DomainError], int] = {
    InvalidInput: 400,
    Forbidden: 403,
    NotFound: 404,
    Conflict: 409,
}


class OpenAIError(OpenAIRequestError):
    """The shared OpenAI-surface error plus what only the gateway sends: an explicit ``type``
    and response headers (``retry-after``, rate-limit headers)."""

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
        super().__init__(status, message, param=param, code=code)
        self.type = type
        self.headers = headers or {}

    def response(self) -> Response:
        body = error_body(self.message, status=self.status, param=self.param, code=self.code, type=self.type)
        return json_response(body, status=self.status, headers=self.headers)


def json_response(body: dict[str, Any], *, status: int, headers: Mapping[str, str] | None = None) -> Response:
    """A JSON response serialized with orjson (FastAPI's ORJSONResponse is deprecated)."""
    return Response(orjson.dumps(body), status_code=status, headers=headers, media_type="application/json")


def domain_error_response(exc: DomainError) -> Response:
    status = next((code for kind, code in DOMAIN_ERROR_STATUS.items() if isinstance(exc, kind)), 400)
    return json_response(
        error_body(exc.message, status=status, param=exc.param, code=exc.code), status=status
    )


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path: Starlette's 405 names only the first route's.
    HEAD, which Starlette adds to every GET, is left out, as the OpenAPI document leaves it out."""
    methods: set[str] = set()
    for route in request.app.routes:
        if isinstance(route, Route) and route.methods and route.path_regex.match(request.url.path):
            methods |= route.methods
    return sorted(methods - {"HEAD"})


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    return describe_validation_errors(list(exc.errors()))


def install_error_handlers(app: FastAPI) -> None:
    """Make FastAPI's own errors (validation, 404, 405) OpenAI-shaped too."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> Response:
        return exc.response()

    @app.exception_handler(DomainError)
    async def _domain_error(_: Request, exc: DomainError) -> Response:
        return domain_error_response(exc)

    @app.exception_handler(DBAPIError)
    async def _database_error(_: Request, exc: DBAPIError) -> Response:
        """A value Postgres cannot store (a NUL character, a number past its column) is the
        client's error, though no schema named it; anything else is ours."""
        sqlstate = str(getattr(exc.orig, "sqlstate", "") or "")
        if sqlstate.startswith(DATA_EXCEPTION_CLASS):
            message = "Invalid value in the request: it cannot be stored (a NUL character, a number too big)."
            return json_response(error_body(message, status=400), status=400)
        log.exception("database error")
        return OpenAIError(500, "Internal server error.", type="server_error").response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        errors = list(exc.errors())
        if errors and errors[0].get("loc", ("",))[0] == "path":
            # A malformed id in the path (/admin/tenants/None) names nothing: 404, like an unknown one.
            return json_response(error_body(f"Nothing at {request.url.path}.", status=404), status=404)
        message, param = _validation_message(exc)
        return json_response(error_body(message, status=400, param=param), status=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        headers = {k.lower(): v for k, v in (getattr(exc, "headers", None) or {}).items()}
        if exc.status_code == 405:
            headers["allow"] = ", ".join(allowed_methods(request))
        return json_response(
            error_body(str(exc.detail), status=exc.status_code), status=exc.status_code, headers=headers
        )
