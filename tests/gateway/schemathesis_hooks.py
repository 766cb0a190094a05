"""Schemathesis hooks for ``test_schemathesis.py`` (loaded by ``st`` through ``SCHEMATHESIS_HOOKS``).

One rule of the chat API is beyond JSON Schema: a ``tool_choice`` naming a function must name one of
the request's ``tools`` (else a 400, as on OpenAI). Generated bodies that name a function get the
name of their first tool, so they stay valid requests and still reach the engine path. The same for
``/v1/responses``, whose tools and named choice are flat (``{"type": "function", "name": ...}``).
"""

from __future__ import annotations

from typing import Any

import schemathesis


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    if not isinstance(body, dict):
        return body
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not (isinstance(tools, list) and tools and isinstance(choice, dict)):
        return body
    first, function = tools[0], choice.get("function")
    if "name" in choice and isinstance(first, dict) and isinstance(first.get("name"), str):
        return body | {"tool_choice": choice | {"name": first["name"]}}
    name = first.get("function", {}).get("name") if isinstance(first, dict) else None
    if isinstance(function, dict) and isinstance(name, str):
        return body | {"tool_choice": choice | {"function": function | {"name": name}}}
    return body


@schemathesis.hook
def before_call(context: Any, case: Any, **kwargs: Any) -> None:
    """The coverage phase builds its bodies without ``map_body``: the same rename, just before sending."""
    case.body = map_body(context, case.body)
