"""RPC frames to the Responses API's shapes: one ``response`` object, or its stream of events.

A stream goes as OpenAI documents it: ``response.created``, ``response.in_progress``; for a reasoning
model's thinking ``response.output_item.added`` (a ``reasoning`` item), ``response.reasoning_text.delta``...,
``response.reasoning_text.done``, ``response.output_item.done``; for text
``response.output_item.added`` (a message), ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``; for each function call ``response.output_item.added``,
``response.function_call_arguments.delta``, ``response.function_call_arguments.done``,
``response.output_item.done``; then ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut it, ``response.failed`` on an engine error) with the usage, cached
tokens included. Every event carries its ``sequence_number``; there is no ``[DONE]``.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from protocol.openai.responses_request import ResponsesRequest
from protocol.rpc import DeltaFrame, ErrorFrame, FinalFrame, ToolCall


def usage_of(final: FinalFrame | ErrorFrame) -> dict[str, Any]:
    return {
        "input_tokens": final.prompt_tokens,
        "input_tokens_details": {"cached_tokens": final.cached_tokens},
        "output_tokens": final.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": getattr(final, "reasoning_tokens", 0)},
        "total_tokens": final.prompt_tokens + final.completion_tokens,
    }


class ResponseBuilder:
    """The answer as it grows: its output items, and the ``response`` object around them."""

    def __init__(self, request: ResponsesRequest, *, request_id: str, created: int | None = None) -> None:
        self.request = request
        self.id = f"resp_{request_id}"
        self.message_id = f"msg_{request_id}"
        self.reasoning_id = f"rs_{request_id}"
        self.reasoning: list[str] = []
        self.created = int(time.time()) if created is None else created
        self.text: list[str] = []
        self.calls: list[ToolCall] = []

    def message_item(self, *, done: bool) -> dict[str, Any]:
        content = [{"type": "output_text", "text": "".join(self.text), "annotations": [], "logprobs": []}]
        return {
            "type": "message",
            "id": self.message_id,
            "status": "completed" if done else "in_progress",
            "role": "assistant",
            "content": content if done else [],
        }

    def reasoning_item(self, *, done: bool) -> dict[str, Any]:
        text = "".join(self.reasoning)
        return {
            "type": "reasoning",
            "id": self.reasoning_id,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if done else [],
            "status": "completed" if done else "in_progress",
        }

    @property
    def message_index(self) -> int:
        """The message's place among the output items: after the reasoning, if any."""
        return 1 if self.reasoning else 0

    def call_item(self, call: ToolCall, *, done: bool) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": f"fc_{call.id}",
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments if done else "",
            "status": "completed" if done else "in_progress",
        }

    def output(self) -> list[dict[str, Any]]:
        items = [self.reasoning_item(done=True)] if self.reasoning else []
        items += [self.message_item(done=True)] if self.text and "".join(self.text) else []
        return items + [self.call_item(call, done=True) for call in self.calls]

    def body(self, *, status: str, final: FinalFrame | ErrorFrame | None = None) -> dict[str, Any]:
        request = self.request
        fmt = (
            request.text.format.model_dump(by_alias=True, exclude_none=True)
            if request.text
            else {"type": "text"}
        )
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": request.model,
            "output": self.output() if final is not None else [],
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": request.reasoning.effort if request.reasoning else None, "summary": None},
            "store": False,
            "temperature": request.temperature,
            "text": {"format": fmt},
            "tool_choice": _tool_choice(request),
            "tools": [t.model_dump(exclude_none=True) for t in request.tools or []],
            "top_p": request.top_p,
            "truncation": "disabled",
            "usage": usage_of(final) if final is not None else None,
            "metadata": {},
        }
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if isinstance(final, ErrorFrame):
            body["error"] = {"code": final.code or "server_error", "message": final.message}
        return body

    def add(self, frame: DeltaFrame) -> None:
        if frame.reasoning:
            self.reasoning.append(frame.reasoning)
        if frame.text:
            self.text.append(frame.text)
        self.calls.extend(frame.tool_calls or [])

    def response(self, final: FinalFrame) -> dict[str, Any]:
        """The whole answer, once the engine's final frame came."""
        return self.body(status=_status(final), final=final)


def _status(final: FinalFrame) -> str:
    return "incomplete" if final.finish_reason == "length" else "completed"


def _tool_choice(request: ResponsesRequest) -> Any:
    choice = request.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


class ResponsesStream:
    """RPC frames in, the Responses API's server-sent events out."""

    def __init__(self, request: ResponsesRequest, *, request_id: str, created: int | None = None) -> None:
        self.builder = ResponseBuilder(request, request_id=request_id, created=created)
        self.sequence = 0
        self.message_open = False
        self.reasoning_open = False

    def _event(self, kind: str, **payload: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence} | payload
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def start(self) -> bytes:
        opening = self.builder.body(status="in_progress")
        return self._event("response.created", response=opening) + self._event(
            "response.in_progress", response=opening
        )

    def frame(self, frame: DeltaFrame | FinalFrame | ErrorFrame) -> bytes:
        if isinstance(frame, DeltaFrame):
            return self._delta(frame)
        out = self._close_reasoning() + self._close_message()
        if isinstance(frame, FinalFrame):
            status = _status(frame)
            return out + self._event(f"response.{status}", response=self.builder.response(frame))
        failed = self.builder.body(status="failed", final=frame)
        return out + self._event("response.failed", response=failed)

    def _delta(self, frame: DeltaFrame) -> bytes:
        out = self._reasoning(frame.reasoning) if frame.reasoning else b""
        builder = self.builder
        if frame.text:
            out += self._close_reasoning()
            index = builder.message_index
            if not self.message_open:
                self.message_open = True
                out += self._event(
                    "response.output_item.added", output_index=index, item=builder.message_item(done=False)
                )
                out += self._event(
                    "response.content_part.added",
                    item_id=builder.message_id,
                    output_index=index,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                )
            builder.text.append(frame.text)
            out += self._event(
                "response.output_text.delta",
                item_id=builder.message_id,
                output_index=index,
                content_index=0,
                delta=frame.text,
                logprobs=[],
            )
        if frame.tool_calls:
            out += self._close_reasoning() + self._close_message()
            for call in frame.tool_calls:
                out += self._call(call)
        return out

    def _reasoning(self, text: str) -> bytes:
        builder = self.builder
        out = b""
        if not self.reasoning_open:
            self.reasoning_open = True
            builder.reasoning.append("")  # the item exists from here on: the message goes after it
            out += self._event(
                "response.output_item.added", output_index=0, item=builder.reasoning_item(done=False)
            )
        builder.reasoning.append(text)
        return out + self._event(
            "response.reasoning_text.delta",
            item_id=builder.reasoning_id,
            output_index=0,
            content_index=0,
            delta=text,
        )

    def _close_reasoning(self) -> bytes:
        if not self.reasoning_open:
            return b""
        self.reasoning_open = False
        builder = self.builder
        item = builder.reasoning_item(done=True)
        return self._event(
            "response.reasoning_text.done",
            item_id=builder.reasoning_id,
            output_index=0,
            content_index=0,
            text=item["content"][0]["text"],
        ) + self._event("response.output_item.done", output_index=0, item=item)

    def _close_message(self) -> bytes:
        if not self.message_open:
            return b""
        self.message_open = False
        builder = self.builder
        item = builder.message_item(done=True)
        index = builder.message_index
        ids = {"item_id": builder.message_id, "output_index": index, "content_index": 0}
        return (
            self._event("response.output_text.done", **ids, text=item["content"][0]["text"], logprobs=[])
            + self._event("response.content_part.done", **ids, part=item["content"][0])
            + self._event("response.output_item.done", output_index=index, item=item)
        )

    def _call(self, call: ToolCall) -> bytes:
        builder = self.builder
        index = (1 if builder.reasoning else 0) + (1 if builder.text else 0) + len(builder.calls)
        builder.calls.append(call)
        item_id = f"fc_{call.id}"
        return (
            self._event(
                "response.output_item.added", output_index=index, item=builder.call_item(call, done=False)
            )
            + self._event(
                "response.function_call_arguments.delta",
                item_id=item_id,
                output_index=index,
                delta=call.arguments,
            )
            + self._event(
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=index,
                name=call.name,
                arguments=call.arguments,
            )
            + self._event(
                "response.output_item.done", output_index=index, item=builder.call_item(call, done=True)
            )
        )


class ChatChunkFrames:
    """An OpenAI-compatible server's chat answer (its chunks, or one object) as the RPC's frames, so
    that the Responses shape is written from it as from a Tern engine's. Streamed tool calls arrive
    in pieces by index; they are put together and sent when the choice finishes."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, str]] = {}
        self.finish_reason = "stop"

    def frames(self, chunk: dict[str, Any]) -> list[DeltaFrame]:
        out: list[DeltaFrame] = []
        for choice in chunk.get("choices") or ():
            delta = (choice.get("delta") if isinstance(choice, dict) else None) or {}
            if isinstance(delta.get("reasoning_content"), str) and delta["reasoning_content"]:
                out.append(DeltaFrame(reasoning=delta["reasoning_content"]))
            if isinstance(delta.get("content"), str) and delta["content"]:
                out.append(DeltaFrame(text=delta["content"]))
            for piece in delta.get("tool_calls") or ():
                call = self._calls.setdefault(
                    int(piece.get("index", 0)), {"id": "", "name": "", "arguments": ""}
                )
                function = piece.get("function") or {}
                call["id"] = piece.get("id") or call["id"]
                call["name"] = function.get("name") or call["name"]
                call["arguments"] += function.get("arguments") or ""
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
                out += self.pending_calls()
        return out

    def pending_calls(self) -> list[DeltaFrame]:
        """The calls put together so far (at the choice's end, or when the stream ends without one)."""
        calls = [ToolCall(**self._calls[i]) for i in sorted(self._calls)]
        self._calls = {}
        return [DeltaFrame(tool_calls=calls)] if calls else []

    def answer(self, answer: dict[str, Any]) -> DeltaFrame:
        """A whole ``chat.completion`` object's first choice as one frame."""
        choice = (answer.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        self.finish_reason = str(choice.get("finish_reason") or "stop")
        calls = [
            ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
            for c in message.get("tool_calls") or ()
        ]
        return DeltaFrame(
            text=message.get("content") or "",
            reasoning=message.get("reasoning_content") or None,
            tool_calls=calls or None,
        )
