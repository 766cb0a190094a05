"""Wire requests -> the core's :class:`EngineRequest`: model check, chat template and tokenisation.

This runs in the server's request handler (in a worker thread, see
:meth:`EngineThread.generate`), not on the step thread, so templating and encoding
long prompts do not hold up the forward pass.
"""

from __future__ import annotations

from dataclasses import fields
from functools import partial

from engine.core.outputs import EngineRequest, ErrorKind, RequestError, SamplingParams
from engine.structured.grammar import Grammar, GrammarCompiler, lark_json
from engine.structured.reasoning import (
    THINKING_BUDGET_CHARS,
    ReasoningParser,
    ThinkingMode,
    after_thinking,
    thinking_mode,
)
from engine.structured.tool_calls import (
    ToolCallFormat,
    ToolCallParser,
    template_supports_tools,
    tool_call_format,
)
from engine.structured.tools import forced_call_grammar, prompt_messages
from engine.tokenizer import Tokenizer
from protocol.rpc import GenerateRequest, ToolSpec
from protocol.rpc import SamplingParams as WireSamplingParams


def sampling_params(wire: WireSamplingParams) -> SamplingParams:
    """The core's sampling parameters from the RPC's (already validated) ones: same names, lists
    as tuples (the core's are frozen)."""
    values = {f.name: getattr(wire, f.name) for f in fields(SamplingParams)}
    return SamplingParams(**values | {"stop": tuple(wire.stop), "stop_token_ids": tuple(wire.stop_token_ids)})


def check_model(request: GenerateRequest, model_name: str) -> None:
    """Refuse a request for another model (checked before any tokenising)."""
    if request.model is not None and request.model != model_name:
        raise RequestError(
            f"The model '{request.model}' does not exist; this engine serves '{model_name}'.",
            kind=ErrorKind.MODEL_NOT_FOUND,
            param="model",
        )


def active_tools(request: GenerateRequest) -> list[ToolSpec]:
    """The tools the model is told about: none with ``tool_choice: none`` (it must not call them)."""
    return list(request.tools or []) if request.tool_choice != "none" else []


def render(request: GenerateRequest, tokenizer: Tokenizer) -> str:
    """A chat request's prompt text: its messages (and tools) through the chat template, with the
    request's ``chat_template_kwargs`` (``enable_thinking``) as template variables."""
    messages = [m.model_dump(exclude_none=True) for m in request.messages or []]
    tools = None
    if request.tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages, tools = prompt_messages(
            messages,
            active_tools(request),
            template_has_tools=template_supports_tools(tokenizer.chat_template),
        )
    extra = dict(request.chat_template_kwargs or {})
    for reserved in ("messages", "tools", "xml_tools", "add_generation_prompt", *tokenizer.special_tokens):
        extra.pop(reserved, None)  # a client may not overwrite what the server passes
    if tools and "xml_tools" in (tokenizer.chat_template or ""):
        extra["xml_tools"] = [t["function"] for t in tools]  # SmolLM3's template takes them so
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, **extra)
    except Exception as exc:  # template errors are the caller's input problem
        raise RequestError(f"could not apply the chat template: {exc}", param="messages") from exc


def tokenize(request: GenerateRequest, tokenizer: Tokenizer, prompt_text: str | None = None) -> list[int]:
    """The prompt's token ids: chat messages through the template, text encoded, ids as given."""
    if request.messages is not None:
        text = render(request, tokenizer) if prompt_text is None else prompt_text
        return tokenizer.encode(text, add_special_tokens=False)  # the template wrote its special tokens
    if isinstance(request.prompt, str):
        return tokenizer.encode(request.prompt)
    return list(request.prompt or [])


def tool_format(chat_template: str | None, override: str = "auto") -> ToolCallFormat:
    """The tool-call format: the engine's ``--tool-call-parser`` if set, else the chat template's."""
    return tool_call_format(chat_template) if override == "auto" else ToolCallFormat(override)


def grammar(
    request: GenerateRequest,
    grammars: GrammarCompiler,
    fmt: ToolCallFormat,
    thinking: ThinkingMode | None = None,
    thinking_budget_chars: int = THINKING_BUDGET_CHARS,
) -> Grammar | None:
    """The grammar a request's output is held to: a forced tool call, else its JSON schema, else none;
    behind a free think block where the model thinks first (the answer alone is constrained).
    Compiled here, in the request's worker thread, so the step loop never waits on it."""
    tools = active_tools(request)
    lark, param = None, "response_format"
    if tools:
        lark = forced_call_grammar(tools, request.tool_choice, parallel=request.parallel_tool_calls, fmt=fmt)
        param = "tools"
    if lark is None and request.json_schema is not None:
        if thinking is None:
            return grammars.json_schema(request.json_schema)
        lark = lark_json(request.json_schema)
    if lark is None:
        return None
    if thinking is not None:
        lark = after_thinking(lark, thinking, thinking_budget_chars)
    return grammars.compile(lark, param=param)


def engine_request(
    request: GenerateRequest,
    tokenizer: Tokenizer,
    *,
    model_name: str,
    grammars: GrammarCompiler,
    tool_call_parser: str = "auto",
    thinking_budget_chars: int = THINKING_BUDGET_CHARS,
) -> EngineRequest:
    """Check and tokenise a wire request; raises :class:`RequestError` for bad input."""
    check_model(request, model_name)
    tools = active_tools(request)
    template = tokenizer.chat_template
    fmt = tool_format(template, tool_call_parser)
    prompt_text = render(request, tokenizer) if request.messages is not None else None
    thinking = None if prompt_text is None else thinking_mode(template, prompt_text)
    prompt = tokenize(request, tokenizer, prompt_text)
    if request.max_prompt_tokens is not None and len(prompt) > request.max_prompt_tokens:
        # The gateway reserved fewer tokens than this prompt has: refused before any work, with the
        # exact count, so the gateway can reserve it (or refuse the request) and send it again.
        refusal = RequestError(
            f"The prompt has {len(prompt)} tokens, more than the {request.max_prompt_tokens} reserved.",
            kind=ErrorKind.PROMPT_OVER_RESERVATION,
            param="messages" if request.messages is not None else "prompt",
        )
        refusal.prompt_tokens = len(prompt)
        raise refusal
    return EngineRequest(
        request_id=request.request_id,
        prompt_token_ids=prompt,
        sampling=sampling_params(request.sampling),
        cache_namespace=request.cache_namespace,
        deadline=request.deadline,
        grammar=grammar(request, grammars, fmt, thinking, thinking_budget_chars),
        tool_parser=partial(ToolCallParser, [t.function.name for t in tools], fmt) if tools else None,
        reasoning_parser=partial(ReasoningParser, thinking) if thinking is not None else None,
    )
