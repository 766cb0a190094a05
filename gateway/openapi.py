"""The gateway's OpenAPI document: complete (the direct-lane /v1 routes too) and true to what it answers.

FastAPI's generated document is the start. What this module adds:
- the two generation routes, which the app serves outside FastAPI's routing (``GatewayApp``), described
  from the same pydantic models that validate them;
- every error a route can answer, in OpenAI's shape: the gateway answers bad input with 400 (not
  FastAPI's 422), and any route may answer 401/403 (the key), 404/409 (the object), 413 (the body);
  the /v1 generation routes also 402/429 (limits) and 503 (no engine);
- a ``pattern`` for ids instead of ``format: uuid``, which JSON Schema only annotates: a client (or a
  fuzzer) reading the document learns that "None" is not an id;
- the bearer-key security scheme, so /docs can send requests.

The document is public, like the code: it lists routes, never data, and every route in it still needs
a key. ``tests/gateway/test_schemathesis.py`` checks the running gateway against it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from protocol.openai.requests import ChatCompletionRequest, CompletionRequest
from protocol.openai.responses_request import ResponsesRequest

_HEX = "[0-9a-fA-F]"
UUID_PATTERN = f"^({_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}|{_HEX}{{32}})$"

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

ERROR_DESCRIPTIONS = {
    "400": "Invalid request (OpenAI's invalid_request_error)",
    "401": "Missing, unknown, revoked or expired API key",
    "402": "Over a monthly budget (when TERN_LIMITS_BUDGET_STATUS=402)",
    "403": "The key may not do this (wrong kind, another tenant, a model outside its scope)",
    "404": "No such object, or not one this key may see",
    "409": "The object's state forbids it",
    "413": "Request body too large",
    "429": "Rate limit, concurrency limit or budget exceeded; see retry-after",
    "503": "No healthy engine, or limits unavailable and the key fails closed",
}
ADMIN_ERRORS = ("400", "401", "403", "404", "409", "413")
GENERATION_ERRORS = ("400", "401", "402", "403", "404", "413", "429", "503")
PUBLIC_PATHS = ("/healthz", "/readyz", "/metrics")

GENERATION_ROUTES: dict[str, tuple[type[BaseModel], str, str]] = {
    "/v1/chat/completions": (ChatCompletionRequest, "Create a chat completion", "chat.completion"),
    "/v1/completions": (CompletionRequest, "Create a text completion", "text_completion"),
    "/v1/responses": (ResponsesRequest, "Create a response (stateless: store false)", "response"),
}


def _generation_operation(summary: str, obj: str, schema_name: str) -> dict[str, Any]:
    return {
        "tags": ["openai"],
        "summary": summary,
        "operationId": f"create_{obj.replace('.', '_')}",
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema_name}"}}},
        },
        "responses": {
            "200": {
                "description": f"A {obj} object; with stream=true, server-sent events of chunks, then [DONE]",
                "content": {
                    "application/json": {
                        "schema": {"type": "object", "required": ["id", "object", "choices"]}
                    },
                    "text/event-stream": {"schema": {"type": "string"}},
                },
            }
        },
    }


def _add_generation_routes(document: dict[str, Any]) -> None:
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for path, (request_cls, summary, obj) in GENERATION_ROUTES.items():
        schema = request_cls.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[request_cls.__name__] = schema
        document["paths"][path] = {"post": _generation_operation(summary, obj, request_cls.__name__)}


def _document_errors(document: dict[str, Any]) -> None:
    document["components"]["schemas"]["Error"] = ERROR_SCHEMA
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for path, operations in document["paths"].items():
        if path in PUBLIC_PATHS:
            continue
        for operation in operations.values():
            responses = operation["responses"]
            responses.pop("422", None)  # the gateway answers validation errors with 400
            codes = GENERATION_ERRORS if path.startswith("/v1/") and "post" in operations else ADMIN_ERRORS
            for code in codes:
                responses.setdefault(code, {"description": ERROR_DESCRIPTIONS[code], **error})
            operation["security"] = [{"bearerKey": []}]
    for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 body, never sent
        document["components"]["schemas"].pop(unused, None)
    document["components"]["securitySchemes"] = {
        "bearerKey": {"type": "http", "scheme": "bearer", "description": "A Tern API key (tern_sk_...)"}
    }


def _say_what_is_checked(node: Any) -> None:
    """Every ``format: uuid`` string gets the pattern the server checks instead (either case, all
    four hyphens or none, as the server parses ids), so the document says exactly what is accepted."""
    if isinstance(node, dict):
        if node.get("format") == "uuid" and node.get("type") == "string":
            del node["format"]
            node["pattern"] = UUID_PATTERN
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict) and len(patterns) == 1 and "additionalProperties" not in node:
            # pydantic's dict[ConstrainedKey, V]: a key that misses the pattern would pass as an
            # "additional" property; say instead that every key must match.
            [(pattern, value_schema)] = patterns.items()
            del node["patternProperties"]
            node["additionalProperties"] = value_schema
            node["propertyNames"] = {**node.get("propertyNames", {}), "pattern": pattern}
        for value in node.values():
            _say_what_is_checked(value)
    elif isinstance(node, list):
        for value in node:
            _say_what_is_checked(value)


def build_openapi(app: FastAPI) -> dict[str, Any]:
    document = get_openapi(
        title=app.title, version=app.version, routes=app.routes, description=app.description
    )
    _add_generation_routes(document)
    _document_errors(document)
    _say_what_is_checked(document)
    return document


def install_openapi(app: FastAPI) -> None:
    """Serve :func:`build_openapi`'s document at /openapi.json (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
