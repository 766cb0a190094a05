"""Core outputs -> the RPC's frames (``protocol/rpc.py``): deltas, usage, logprobs.

Logprob tokens are decoded here, from the ids the core reports, so that text is
produced off the step thread.
"""

from __future__ import annotations

from engine.core.llm_engine import LLMEngine
from engine.core.outputs import ChoiceDelta, Logprob, RequestOutput, RequestUsage
from engine.serving.requests import engine_request
from engine.tokenizer import Tokenizer
from protocol.rpc import (
    DeltaFrame,
    ErrorFrame,
    FinalFrame,
    GenerateRequest,
    TokenLogprob,
    ToolCall,
    TopLogprob,
)

Frame = DeltaFrame | FinalFrame | ErrorFrame


def to_frames(out: RequestOutput, tokenizer: Tokenizer) -> list[DeltaFrame | FinalFrame]:
    """The frames one output becomes: its deltas, then the final frame if it finished."""
    frames: list[DeltaFrame | FinalFrame] = [delta_frame(d, tokenizer) for d in out.deltas]
    if out.usage is not None:
        frames.append(final_frame(out.usage))
    return frames


def delta_frame(delta: ChoiceDelta, tokenizer: Tokenizer) -> DeltaFrame:
    frame = DeltaFrame(
        index=delta.index, text=delta.text, token_ids=list(delta.token_ids), finish_reason=delta.finish_reason
    )
    if delta.reasoning:
        frame.reasoning = delta.reasoning
    if delta.logprobs is not None:
        frame.logprobs = [token_logprob(lp, tokenizer) for lp in delta.logprobs]
    if delta.tool_calls:
        frame.tool_calls = [ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in delta.tool_calls]
    return frame


def final_frame(usage: RequestUsage) -> FinalFrame:
    return FinalFrame(
        finish_reason=usage.finish_reason,
        finish_reasons=list(usage.finish_reasons),
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        completion_tokens=usage.completion_tokens,
        reasoning_tokens=usage.reasoning_tokens,
    )


def error_frame(message: str, usage: RequestUsage | None) -> ErrorFrame:
    """A failure after the stream began, counting what the request had used."""
    if usage is None:
        return ErrorFrame(message=message)
    return ErrorFrame(
        message=message,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        completion_tokens=usage.completion_tokens,
    )


def token_logprob(logprob: Logprob, tokenizer: Tokenizer) -> TokenLogprob:
    top = [
        TopLogprob(token=(s := _token_text(t, tokenizer)), logprob=lp, bytes=list(s.encode()))
        for t, lp in logprob.top
    ]
    text = _token_text(logprob.token_id, tokenizer)
    return TokenLogprob(token=text, logprob=logprob.logprob, bytes=list(text.encode()), top_logprobs=top)


def _token_text(token_id: int, tokenizer: Tokenizer) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def generate_frames(
    engine: LLMEngine, requests: list[GenerateRequest]
) -> dict[str, list[DeltaFrame | FinalFrame]]:
    """Run wire requests to completion (tests, offline use): the frames each would stream."""
    core = [
        engine_request(
            r,
            engine.tokenizer,
            model_name=engine.model_name,
            grammars=engine.grammars,
            tool_call_parser=engine.config.tool_call_parser,
            thinking_budget_chars=engine.config.thinking_budget_chars,
        )
        for r in requests
    ]
    return {rid: to_frames(out, engine.tokenizer) for rid, out in engine.generate(core).items()}
