"""OpenAI's error body, the exception that carries one, and pydantic errors described in its words."""

from __future__ import annotations

from typing import Any

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
    """OpenAI's error shape; ``type`` defaults from the status code."""
    err_type = type or _TYPE_BY_STATUS.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class OpenAIRequestError(Exception):
    """A request the OpenAI surface refuses; carries everything :func:`error_body` needs."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, status=self.status, param=self.param, code=self.code)


def describe_validation_errors(errors: list[Any]) -> tuple[str, str | None]:
    """A one-line message and the offending parameter for pydantic's first error."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    param = (first.get("ctx") or {}).get("param") or ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "We could not parse the JSON body of your request. It must be valid JSON.", None
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param
    if kind in ("model_type", "model_attributes_type") and not loc:
        return "The request body must be a JSON object.", None
    msg = str(first.get("msg", "Invalid request."))
    msg = msg.removeprefix("Value error, ")
    if kind.startswith("tern_"):
        return msg, param
    return (f"Invalid value for '{param}': {msg}" if param else msg), param
