"""Tool calling: telling the model about tools, constraining its calls, and reading them back.

A model family writes tool calls in its own format; two are understood:

- **hermes**: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5/3,
  Hermes 2/3, SmolLM3 and other templates that mention ``<tool_call>``), and the format
  Tern itself describes to a model whose chat template knows nothing of tools (SmolLM2);
- **llama3_json**: one bare JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.1+).

With ``tool_choice`` ``required`` or a named function, the call is constrained by a grammar
in that same format, with the arguments held to the function's parameter schema, so it
always parses. With ``auto`` the model decides, and :class:`ToolCallParser` finds the calls.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from engine.core.outputs import ToolCall
from engine.structured.grammar import json_with_options
from protocol.rpc import NamedToolChoice, ToolChoice, ToolSpec

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(OPEN_TAG) + r"\s*(.*?)\s*" + re.escape(CLOSE_TAG), re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"

FALLBACK_PROMPT = """You can call functions to help with the user's request. The functions, as JSON schemas:
<tools>
{tools}
</tools>
To call functions, answer with one block per call, each holding a JSON object with the function's name \
and its arguments, and nothing else:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}
</tool_call>
Each function's result comes back to you in a message from the tool."""
"""For chat templates without tool support: a system-prompt description in the hermes format."""


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


def prompt_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[ToolSpec], *, template_has_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (and ``tools`` argument) to render: the template's own tool support where it
    has some, else :data:`FALLBACK_PROMPT` and tool turns written out as text."""
    if template_has_tools:
        specs = [t.model_dump(exclude_none=True) for t in tools] or None
        return [_with_parsed_arguments(m) for m in messages], specs
    out = [_as_text_turn(m) for m in messages]
    if tools:
        described = "\n".join(json.dumps(t.function.model_dump(exclude_none=True)) for t in tools)
        instructions = FALLBACK_PROMPT.format(tools=described)
        if out and out[0]["role"] == "system":
            out[0] = out[0] | {"content": f"{out[0]['content'] or ''}\n\n{instructions}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out, None


def _with_parsed_arguments(message: Mapping[str, Any]) -> dict[str, Any]:
    """Templates (Hugging Face's convention) take a call's arguments as a dict, not JSON text."""
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    parsed = []
    for call in calls:
        function = dict(call["function"])
        try:
            function["arguments"] = json.loads(function["arguments"])
        except (TypeError, ValueError):
            pass
        parsed.append(dict(call) | {"function": function})
    return dict(message) | {"tool_calls": parsed}


def _as_text_turn(message: Mapping[str, Any]) -> dict[str, Any]:
    """A tool call as plain text, for templates that only know role and content."""
    role, content = message["role"], message.get("content") or ""
    if role == "assistant" and message.get("tool_calls"):
        blocks = [_hermes_block(**c["function"]) for c in message["tool_calls"]]
        return {"role": "assistant", "content": "\n".join([content, *blocks]).strip()}
    # A result keeps its own role: ChatML templates write any role, and small models answer from a
    # "tool" turn where they echo a <tool_response> block in a user turn (measured on SmolLM2).
    return {"role": role, "content": content}


def _hermes_block(name: str, arguments: str) -> str:
    return f'{OPEN_TAG}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{CLOSE_TAG}'


# -- the constraint ----------------------------------------------------------------------------


def forced_call_grammar(
    tools: Sequence[ToolSpec], choice: ToolChoice, *, parallel: bool, fmt: ToolCallFormat
) -> str | None:
    """The Lark grammar that forces a call (``required`` or a named function); None for ``auto``/``none``."""
    if isinstance(choice, NamedToolChoice):
        allowed = [t for t in tools if t.function.name == choice.function.name]
    elif choice == "required":
        allowed = list(tools)
    else:
        return None
    args_key = "parameters" if fmt is ToolCallFormat.LLAMA3_JSON else "arguments"
    one_call = (
        {"anyOf": [_call_schema(t, args_key) for t in allowed]}
        if len(allowed) > 1
        else _call_schema(allowed[0], args_key)
    )
    call_json = f"%json {json_with_options(one_call)}"
    if fmt is ToolCallFormat.LLAMA3_JSON:
        return f"start: {call_json}\n"
    repeat = "+" if parallel else ""
    return f'start: call{repeat}\ncall: "{OPEN_TAG}\\n" body "\\n{CLOSE_TAG}"\nbody: {call_json}\n'


def _call_schema(tool: ToolSpec, args_key: str) -> dict[str, Any]:
    parameters = tool.function.parameters or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, args_key: parameters},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


# -- reading calls back ------------------------------------------------------------------------


class ToolCallParser:
    """Splits one choice's text into content (streamed as it comes) and tool calls (at the end).

    Text before a call streams unchanged; from the start of a call on, text is held back and
    parsed when the choice finishes. Text that does not parse as calls is returned as content,
    so nothing the model wrote is lost."""

    def __init__(self, tools: Sequence[ToolSpec], fmt: ToolCallFormat) -> None:
        self._names = {t.function.name for t in tools}
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
