"""Tool calls in a model's output: the formats model families write them in, and the parser that
finds them (pure text; no wire types, so the engine core can use it)."""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(OPEN_TAG) + r"\s*(.*?)\s*" + re.escape(CLOSE_TAG), re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    """A function call found in a choice's output; ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str


class ToolCallFormat(enum.Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"


def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in (chat_template or "")


def tool_call_format(chat_template: str | None) -> ToolCallFormat:
    """The format the served model writes calls in, read from its chat template."""
    template = chat_template or ""
    if template_supports_tools(template) and OPEN_TAG not in template:
        if _PYTHON_TAG in template or '"parameters"' in template or "ipython" in template:
            return ToolCallFormat.LLAMA3_JSON
    return ToolCallFormat.HERMES


# -- the prompt --------------------------------------------------------------------------------


class ToolCallParser:
    """Splits one choice's text into content (streamed as it comes) and tool calls (at the end).

    Text before a call streams unchanged; from the start of a call on, text is held back and
    parsed when the choice finishes. Text that does not parse as calls is returned as content,
    so nothing the model wrote is lost."""

    def __init__(self, names: Iterable[str], fmt: ToolCallFormat) -> None:
        self._names = set(names)
        self._format = fmt
        self._held = ""
        self._in_call = False
        self._seen_text = False

    def feed(self, text: str) -> str:
        """The part of ``text`` that is content for sure; the rest is held back."""
        if self._in_call:
            self._held += text
            return ""
        text = self._held + text
        self._held = ""
        start = self._call_start(text)
        if start is not None:
            self._in_call = True
            self._held = text[start:]
            return text[:start]
        keep = _partial_suffix(text, OPEN_TAG) if self._format is ToolCallFormat.HERMES else 0
        self._held = text[len(text) - keep :]
        out = text[: len(text) - keep]
        self._seen_text = self._seen_text or bool(out.strip())
        return out

    def _call_start(self, text: str) -> int | None:
        if self._format is ToolCallFormat.HERMES:
            index = text.find(OPEN_TAG)
            return None if index < 0 else index
        if self._seen_text:  # llama3_json: a call is the whole answer
            return None
        stripped = text.lstrip()
        if stripped.startswith(("{", _PYTHON_TAG)):
            return len(text) - len(stripped)
        return None

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left: content not yet returned, and the calls (empty if none parsed)."""
        held, self._held = self._held, ""
        if not self._in_call:
            return held, []
        calls = self._parse(held)
        return ("", calls) if calls else (held, [])

    def _parse(self, text: str) -> list[ToolCall]:
        if self._format is ToolCallFormat.HERMES:
            bodies = _HERMES_BLOCK.findall(text)
            if not bodies or _HERMES_BLOCK.sub("", text).strip():
                return []
        else:
            bodies = [b for b in text.replace(_PYTHON_TAG, "").split(";") if b.strip()]
        calls = []
        for body in bodies:
            call = self._call(body)
            if call is None:
                return []
            calls.append(call)
        return calls

    def _call(self, body: str) -> ToolCall | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self._names:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=value["name"], arguments=arguments)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
