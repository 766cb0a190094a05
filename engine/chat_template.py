"""Chat templates rendered with jinja2 the way transformers renders them.

Same sandbox, same whitespace settings and the same helpers (`raise_exception`, `tojson`,
`strftime_now`), so a model's template produces the exact prompt it was trained on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationTag(Extension):
    """Accept `{% generation %}...{% endgeneration %}` (used for training masks) and render its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja's Extension API

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    special_tokens: Mapping[str, str | None],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages`; `special_tokens` supplies bos_token, eos_token and friends to the template."""
    return compile_template(source).render(
        messages=[dict(m) for m in messages],
        tools=None if tools is None else [dict(t) for t in tools],
        documents=None if documents is None else [dict(d) for d in documents],
        add_generation_prompt=add_generation_prompt,
        **special_tokens,
        **kwargs,
    )
