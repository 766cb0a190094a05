"""RPC frames to OpenAI's formats: SSE chunks for a stream, one response object otherwise."""

from __future__ import annotations

import time
from typing import Any

import orjson

from protocol.openai.errors import error_body
from protocol.openai.requests import ChatCompletionRequest, OpenAIRequest
from protocol.rpc import DeltaFrame, ErrorFrame, FinalFrame, TokenLogprob, ToolCall

Frame = DeltaFrame | FinalFrame | ErrorFrame
SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def usage_dict(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0
) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


def final_usage(final: FinalFrame) -> dict[str, Any]:
    return usage_dict(
        final.prompt_tokens, final.completion_tokens, final.cached_tokens, final.reasoning_tokens
    )


def error_frame_body(frame: ErrorFrame) -> dict[str, Any]:
    return error_body(frame.message, status=frame.status, code=frame.code)


def _chat_logprob(lp: TokenLogprob) -> dict[str, Any]:
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": lp.bytes,
        "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in lp.top_logprobs],
    }


def _tool_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """OpenAI's shape; a streamed call also carries its position among the choice's calls."""
    body = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return body if index is None else {"index": index} | body


def _tool_call_deltas(call: ToolCall, index: int) -> list[dict[str, Any]]:
    """A streamed call as OpenAI streams one: its id and name first, then its arguments as a delta
    (clients concatenate ``arguments`` across chunks)."""
    head = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
    return [{"index": index} | head, {"index": index, "function": {"arguments": call.arguments}}]


def _delta_choice(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}


class _Formatter:
    """Per-request identity (id, model, created) and per-choice bookkeeping."""

    def __init__(self, request: OpenAIRequest, *, request_id: str, created: int | None = None) -> None:
        self.is_chat = isinstance(request, ChatCompletionRequest)
        self.id = f"chatcmpl-{request_id}" if self.is_chat else f"cmpl-{request_id}"
        self.object = "chat.completion" if self.is_chat else "text_completion"
        self.model = request.model
        self.n = request.n
        self.created = int(time.time()) if created is None else created
        self.finish_reasons: dict[int, str] = {}
        self._text_offset: dict[int, int] = {}

    def _completion_logprobs(self, index: int, lps: list[TokenLogprob]) -> dict[str, Any]:
        """Legacy completions logprobs; ``text_offset`` counts characters from the completion start."""
        offset = self._text_offset.get(index, 0)
        offsets = []
        for lp in lps:
            offsets.append(offset)
            offset += len(lp.token)
        self._text_offset[index] = offset
        return {
            "tokens": [lp.token for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{t.token: t.logprob for t in lp.top_logprobs} for lp in lps],
            "text_offset": offsets,
        }

    def _final_reason(self, index: int, final: FinalFrame) -> str:
        if index < len(final.finish_reasons):
            return final.finish_reasons[index]
        return final.finish_reason


class StreamFormatter(_Formatter):
    """RPC frames in, SSE bytes out (``chat.completion.chunk`` / ``text_completion``)."""

    def __init__(self, request: OpenAIRequest, *, request_id: str, created: int | None = None) -> None:
        super().__init__(request, request_id=request_id, created=created)
        self.include_usage = request.include_usage
        self.object = "chat.completion.chunk" if self.is_chat else "text_completion"

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse_event(
            {
                "id": self.id,
                "object": self.object,
                "created": self.created,
                "model": self.model,
                "choices": choices,
            }
            | extra
        )

    def _finish_choice(self, index: int, reason: str) -> dict[str, Any]:
        self.finish_reasons[index] = reason
        if self.is_chat:
            return {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}
        return {"index": index, "text": "", "logprobs": None, "finish_reason": reason}

    def start(self) -> bytes:
        """The opening chunk: chat sends the assistant role for every choice; completions send nothing."""
        if not self.is_chat:
            return b""
        return self._chunk(
            [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(self.n)
            ]
        )

    def frame(self, frame: Frame) -> bytes:
        """SSE bytes for one frame; a final or error frame also ends the stream with ``[DONE]``."""
        if isinstance(frame, DeltaFrame):
            return self._delta(frame)
        if isinstance(frame, FinalFrame):
            return self._final(frame)
        return sse_event(error_frame_body(frame)) + SSE_DONE

    def _delta(self, frame: DeltaFrame) -> bytes:
        out = b""
        if frame.reasoning and self.is_chat:
            out += self._chunk([_delta_choice(frame.index, {"reasoning_content": frame.reasoning})])
        if frame.tool_calls and self.is_chat:
            out += b"".join(
                self._chunk([_delta_choice(frame.index, {"tool_calls": [part]})])
                for k, call in enumerate(frame.tool_calls)
                for part in _tool_call_deltas(call, k)
            )
        if frame.text or frame.logprobs:
            if self.is_chat:
                logprobs = (
                    {"content": [_chat_logprob(lp) for lp in frame.logprobs]} if frame.logprobs else None
                )
                choice = {"index": frame.index, "delta": {"content": frame.text}, "logprobs": logprobs}
            else:
                logprobs = self._completion_logprobs(frame.index, frame.logprobs) if frame.logprobs else None
                choice = {"index": frame.index, "text": frame.text, "logprobs": logprobs}
            if frame.finish_reason is not None and not self.is_chat:
                self.finish_reasons[frame.index] = frame.finish_reason
                return self._chunk([choice | {"finish_reason": frame.finish_reason}])
            out += self._chunk([choice | {"finish_reason": None}])
        if frame.finish_reason is not None:
            out += self._chunk([self._finish_choice(frame.index, frame.finish_reason)])
        return out

    def _final(self, final: FinalFrame) -> bytes:
        out = b"".join(
            self._chunk([self._finish_choice(i, self._final_reason(i, final))])
            for i in range(self.n)
            if i not in self.finish_reasons
        )
        if self.include_usage:
            out += self._chunk([], usage=final_usage(final))
        return out + SSE_DONE


class ResponseAccumulator(_Formatter):
    """RPC frames in, one ``chat.completion`` / ``text_completion`` object out."""

    def __init__(self, request: OpenAIRequest, *, request_id: str, created: int | None = None) -> None:
        super().__init__(request, request_id=request_id, created=created)
        self._text: dict[int, list[str]] = {i: [] for i in range(self.n)}
        self._logprobs: dict[int, list[TokenLogprob]] = {}
        self._tool_calls: dict[int, list[ToolCall]] = {}
        self._reasoning: dict[int, list[str]] = {}

    def add(self, frame: DeltaFrame) -> None:
        self._text.setdefault(frame.index, []).append(frame.text)
        if frame.reasoning:
            self._reasoning.setdefault(frame.index, []).append(frame.reasoning)
        if frame.tool_calls:
            self._tool_calls.setdefault(frame.index, []).extend(frame.tool_calls)
        if frame.logprobs:
            self._logprobs.setdefault(frame.index, []).extend(frame.logprobs)
        if frame.finish_reason is not None:
            self.finish_reasons[frame.index] = frame.finish_reason

    def response(self, final: FinalFrame) -> dict[str, Any]:
        choices = []
        for index in sorted(self._text):
            text = "".join(self._text[index])
            reason = self.finish_reasons.get(index) or self._final_reason(index, final)
            lps = self._logprobs.get(index)
            if self.is_chat:
                logprobs = {"content": [_chat_logprob(lp) for lp in lps]} if lps else None
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if index in self._reasoning:
                    message["reasoning_content"] = "".join(self._reasoning[index])
                if calls := self._tool_calls.get(index):
                    message["content"] = text or None
                    message["tool_calls"] = [_tool_call(call) for call in calls]
                choice = {"index": index, "message": message}
            else:
                logprobs = self._completion_logprobs(index, lps) if lps else None
                choice = {"index": index, "text": text}
            choices.append(choice | {"logprobs": logprobs, "finish_reason": reason})
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": final_usage(final),
        }
