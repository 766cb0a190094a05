"""Tool calling: telling the model about tools, constraining its calls, and reading them back.

A model family writes tool calls in its own format; two are understood:

- **hermes**: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5/3,
  Hermes 2/3, SmolLM3 and other templates that mention ``<tool_call>``), and the format
  Tern itself describes to a model whose chat template knows nothing of tools (SmolLM2);
- **llama3_json**: one bare JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.1+).

With ``tool_choice`` ``required`` or a named function, the call is constrained by a grammar
in that same format, with the arguments held to the function's parameter schema, so it
always parses. With ``auto`` the model decides, and ``tool_calls.ToolCallParser`` finds the calls.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from engine.structured.grammar import closed_object, json_with_options
from engine.structured.tool_calls import CLOSE_TAG, OPEN_TAG, ToolCallFormat
from protocol.rpc import NamedToolChoice, ToolChoice, ToolSpec

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
    # Templates write a call's turn as content plus calls, and most (Qwen3's) fail on no content.
    message = {"content": ""} | dict(message)
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
    return closed_object(name={"const": tool.function.name}, **{args_key: parameters})
