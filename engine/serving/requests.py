"""Wire requests -> the core's :class:`EngineRequest`: model check, chat template and tokenisation.

This runs in the server's request handler (in a worker thread, see
:meth:`EngineThread.generate`), not on the step thread, so templating and encoding
long prompts do not hold up the forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from functools import partial

from engine.core.outputs import EngineRequest, ErrorKind, RequestError, SamplingParams
from engine.structured.grammar import Grammar, GrammarCompiler
from engine.structured.tool_calls import ToolCallParser, template_supports_tools, tool_call_format
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


def tokenize(request: GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    """The prompt's token ids: chat messages through the template, text encoded, ids as given."""
    if request.messages is not None:
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        tools = None
        if request.tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages, tools = prompt_messages(
                messages,
                active_tools(request),
                template_has_tools=template_supports_tools(tokenizer.chat_template),
            )
        try:
            return tokenizer.encode_chat(messages, tools=tools) if tools else tokenizer.encode_chat(messages)
        except Exception as exc:  # template errors are the caller's input problem
            raise RequestError(f"could not apply the chat template: {exc}", param="messages") from exc
    if isinstance(request.prompt, str):
        return tokenizer.encode(request.prompt)
    return list(request.prompt or [])


def grammar(request: GenerateRequest, grammars: GrammarCompiler, chat_template: str | None) -> Grammar | None:
    """The grammar a request's output is held to: a forced tool call, else its JSON schema, else none.
    Compiled here, in the request's worker thread, so the step loop never waits on it."""
    tools = active_tools(request)
    if tools:
        fmt = tool_call_format(chat_template)
        lark = forced_call_grammar(tools, request.tool_choice, parallel=request.parallel_tool_calls, fmt=fmt)
        if lark is not None:
            return grammars.compile(lark, param="tools")
    if request.json_schema is not None:
        return grammars.json_schema(request.json_schema)
    return None


def tool_parser(tools: list[ToolSpec], chat_template: str | None) -> Callable[[], ToolCallParser] | None:
    """What makes each choice's tool-call parser (None without tools)."""
    if not tools:
        return None
    return partial(ToolCallParser, [t.function.name for t in tools], tool_call_format(chat_template))


def engine_request(
    request: GenerateRequest, tokenizer: Tokenizer, *, model_name: str, grammars: GrammarCompiler
) -> EngineRequest:
    """Check and tokenise a wire request; raises :class:`RequestError` for bad input."""
    check_model(request, model_name)
    tools = active_tools(request)
    prompt = tokenize(request, tokenizer)
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
        grammar=grammar(request, grammars, tokenizer.chat_template),
        tool_parser=partial(
            ToolCallParser, [t.function.name for t in tools], tool_call_format(tokenizer.chat_template)
        )
        if tools
        else None,
    )
