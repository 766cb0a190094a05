"""The chat templates of Qwen3, SmolLM3, Llama 3.1/3.2 and Gemma 3, as their models ship them
(tests/data/chat_templates), rendered through the engine's request path: tools, several turns,
thinking on and off. Each prompt must equal what transformers renders from the same template (the
reference every model was trained against), and show the parts its family's parsers rely on.

Sources: Qwen3-0.6B, Llama-3.1-8B-Instruct and Llama-3.2-3B-Instruct from llama.cpp's
models/templates (copied from the models' Hugging Face repos); SmolLM3-3B and Gemma 3 from their
tokenizer configs as published.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from engine.errors import RequestError
from engine.serving.requests import render, tool_format
from engine.structured.reasoning import ThinkingMode, thinking_mode
from engine.structured.tool_calls import ToolCallFormat
from engine.structured.tools import prompt_messages
from engine.tokenizer import Tokenizer
from protocol.rpc import GenerateRequest, ToolSpec

TEMPLATES = Path(__file__).parent.parent / "data" / "chat_templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TOOL_TURNS: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 18}'},
    {"role": "assistant", "content": "<think>\nIt says 18.\n</think>\n\nIt is 18 C."},
    {"role": "user", "content": "And tomorrow?"},
]
PLAIN_TURNS: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2?"},
]


def with_template(tokenizer: Tokenizer, name: str) -> Tokenizer:
    template = (TEMPLATES / name).read_text()
    return Tokenizer(tokenizer.backend, special_tokens=tokenizer.special_tokens, chat_template=template)


def request(messages: list[dict[str, Any]], *, tools: bool, thinking: bool | None = None) -> GenerateRequest:
    fields: dict[str, Any] = {"request_id": "r", "messages": messages}
    if tools:
        fields["tools"] = [WEATHER]
    if thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": thinking}
    return GenerateRequest.model_validate(fields)


def reference(tokenizer: Tokenizer, generate: GenerateRequest) -> str:
    """transformers' rendering of the same template, messages and tools."""
    messages = [m.model_dump(exclude_none=True) for m in generate.messages or []]
    tools = [ToolSpec.model_validate(t) for t in generate.tools or []]
    messages, specs = prompt_messages(messages, tools, template_has_tools=True)
    extra = dict(generate.chat_template_kwargs or {})
    if specs and "xml_tools" in (tokenizer.chat_template or ""):
        extra["xml_tools"] = [s["function"] for s in specs]
    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=specs,
        chat_template=tokenizer.chat_template,
        add_generation_prompt=True,
        **tokenizer.special_tokens,
        **extra,
    )
    return rendered[0]


@pytest.mark.parametrize("name", ["qwen3.jinja", "smollm3.jinja", "llama3.1.jinja", "llama3.2.jinja"])
@pytest.mark.parametrize("thinking", [None, True, False])
def test_tools_and_turns_render_as_transformers_does(
    default_tokenizer: Tokenizer, name: str, thinking: bool | None
) -> None:
    tokenizer = with_template(default_tokenizer, name)
    generate = request(TOOL_TURNS, tools=True, thinking=thinking)
    prompt = render(generate, tokenizer)
    assert prompt == reference(tokenizer, generate)
    assert "get_weather" in prompt and "Paris" in prompt and "18" in prompt and "And tomorrow?" in prompt


def test_qwen3_thinking_on_and_off(default_tokenizer: Tokenizer) -> None:
    tokenizer = with_template(default_tokenizer, "qwen3.jinja")
    template = tokenizer.chat_template
    on = render(request(TOOL_TURNS, tools=True), tokenizer)
    off = render(request(TOOL_TURNS, tools=True, thinking=False), tokenizer)
    # Tools in <tools>, the earlier call as a <tool_call> block, its result as a <tool_response>.
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in on
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in on
    assert '<tool_response>\n{"celsius": 18}\n</tool_response>' in on
    assert on.endswith("<|im_start|>assistant\n") and off.endswith("<think>\n\n</think>\n\n")
    assert thinking_mode(template, on) == ThinkingMode(opened=False)
    assert thinking_mode(template, off) is None
    assert tool_format(template) is ToolCallFormat.HERMES


def test_reasoning_effort_none_turns_qwen3_thinking_off(default_tokenizer: Tokenizer) -> None:
    from protocol.openai.requests import ChatCompletionRequest

    tokenizer = with_template(default_tokenizer, "qwen3.jinja")
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": PLAIN_TURNS, "reasoning_effort": "none"}
    )
    prompt = render(chat.to_generate_request(request_id="r"), tokenizer)
    assert prompt.endswith("<think>\n\n</think>\n\n")


def test_smollm3_thinking_switches(default_tokenizer: Tokenizer) -> None:
    tokenizer = with_template(default_tokenizer, "smollm3.jinja")
    template = tokenizer.chat_template
    on = render(request(TOOL_TURNS, tools=True), tokenizer)
    off = render(request(TOOL_TURNS, tools=True, thinking=False), tokenizer)
    no_think = [{"role": "system", "content": "Be brief. /no_think"}, *PLAIN_TURNS[1:]]
    switched = render(request(no_think, tools=False), tokenizer)
    assert "Reasoning Mode: /think" in on and "Today Date: " in on  # strftime_now
    assert "### Tools" in on and "'name': 'get_weather'" in on  # xml_tools, namespace and tool | string
    assert "Reasoning Mode: /no_think" in off and "Reasoning Mode: /no_think" in switched
    assert thinking_mode(template, on) == ThinkingMode(opened=False)
    assert thinking_mode(template, off) is None and thinking_mode(template, switched) is None
    assert tool_format(template) is ToolCallFormat.HERMES


@pytest.mark.parametrize("name", ["llama3.1.jinja", "llama3.2.jinja"])
def test_llama3_tools_and_format(default_tokenizer: Tokenizer, name: str) -> None:
    tokenizer = with_template(default_tokenizer, name)
    prompt = render(request(TOOL_TURNS, tools=True), tokenizer)
    assert "Environment: ipython" in prompt and "Today Date: " in prompt
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in prompt
    # The result turn as the template writes a string result (through tojson).
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"celsius\\": 18}"<|eot_id|>' in prompt
    assert thinking_mode(tokenizer.chat_template, prompt) is None
    assert tool_format(tokenizer.chat_template) is ToolCallFormat.LLAMA3_JSON
    assert tool_format(tokenizer.chat_template, "hermes") is ToolCallFormat.HERMES  # --tool-call-parser


def test_gemma3_turns_and_its_own_refusals(default_tokenizer: Tokenizer) -> None:
    tokenizer = with_template(default_tokenizer, "gemma3.jinja")
    generate = request(PLAIN_TURNS, tools=False)
    prompt = render(generate, tokenizer)
    assert prompt == reference(tokenizer, generate)
    assert "<start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello." in prompt
    assert prompt.endswith("<start_of_turn>model\n")
    # No tool support: the tools are described in the system turn; the template's own raise_exception
    # (roles must alternate) refuses a tool turn, as a 400 that names it.
    tools_prompt = render(request(PLAIN_TURNS, tools=True), tokenizer)
    assert "get_weather" in tools_prompt and "<tool_call>" in tools_prompt
    with pytest.raises(RequestError, match="Conversation roles must alternate"):
        render(request(TOOL_TURNS, tools=True), tokenizer)


def test_client_cannot_overwrite_what_the_server_passes(default_tokenizer: Tokenizer) -> None:
    tokenizer = with_template(default_tokenizer, "qwen3.jinja")
    generate = request(PLAIN_TURNS, tools=False)
    generate.chat_template_kwargs = {"messages": [], "add_generation_prompt": False, "bos_token": "X"}
    assert render(generate, tokenizer) == render(request(PLAIN_TURNS, tools=False), tokenizer)
    assert json.dumps(PLAIN_TURNS[-1]["content"])[1:-1] in render(generate, tokenizer)
