"""``/v1/responses`` relayed from a Tern engine: the chat generation, answered in the Responses shape.

The engine runs the chat request the Responses request amounts to
(``ResponsesRequest.to_chat``); this relay only writes its frames as a ``response`` object or as
the Responses API's events (``protocol/openai/responses_events.py``). Opening, aborting, usage and
the completion hooks are :class:`~gateway.proxy.rpc_relay.Relay`'s, unchanged: billed like chat.
"""

from __future__ import annotations

from typing import Any

from gateway.proxy.openai_relay import OpenAIRelay
from gateway.proxy.rpc_relay import FrameAnswer, FrameStream, Relay
from protocol.openai.responses_events import ChatChunkFrames, ResponseBuilder, ResponsesStream
from protocol.openai.responses_request import ResponsesRequest
from protocol.rpc import ErrorFrame, FinalFrame


class ResponsesRelay(Relay):
    def __init__(self, *, responses_request: ResponsesRequest, **relay: Any) -> None:
        super().__init__(**relay)
        self.responses_request = responses_request

    def stream_formatter(self) -> FrameStream:
        return ResponsesStream(self.responses_request, request_id=self.request_id)

    def answer_builder(self) -> FrameAnswer:
        return ResponseBuilder(self.responses_request, request_id=self.request_id)


class ResponsesOpenAIRelay(OpenAIRelay):
    """An OpenAI-compatible engine's chat answer (chunks, or one object) as the Responses API's."""

    def __init__(self, *, responses_request: ResponsesRequest, **relay: Any) -> None:
        super().__init__(**relay)
        self.responses_request = responses_request
        self.events = ResponsesStream(responses_request, request_id=self.request_id)
        self.chunks = ChatChunkFrames()
        self._completed = False

    def _stream_opening(self) -> bytes:
        return self.events.start()

    def _format_event(self, event: dict[str, Any]) -> bytes:
        if "error" in event:
            error = event["error"] if isinstance(event["error"], dict) else {}
            return self._final(
                ErrorFrame(message=str(error.get("message") or "The engine failed."), status=502)
            )
        out = b"".join(self.events.frame(frame) for frame in self.chunks.frames(event))
        if isinstance(event.get("usage"), dict):  # the engine's usage, in the outcome: the last event
            out += self._final(self._final_frame())
        return out

    def _final_frame(self) -> FinalFrame:
        out = self.outcome
        return FinalFrame(
            finish_reason=self.chunks.finish_reason,
            prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
            completion_tokens=out.completion_tokens,
        )

    def _final(self, frame: FinalFrame | ErrorFrame) -> bytes:
        if self._completed:
            return b""
        self._completed = True
        return self.events.frame(frame)

    def _stream_done(self) -> bytes:
        """``[DONE]`` without usage (an engine that reports none): counted here, then completed."""
        self._settle_usage()
        calls = b"".join(self.events.frame(frame) for frame in self.chunks.pending_calls())
        return calls + self._final(self._final_frame())

    def _broken(self) -> bytes:
        super()._broken()
        return self._final(ErrorFrame(message="The engine closed the stream before finishing.", status=502))

    def _format_answer(self, answer: dict[str, Any]) -> dict[str, Any]:
        builder = ResponseBuilder(self.responses_request, request_id=self.request_id)
        builder.add(self.chunks.answer(answer))
        self._settle_usage()
        return builder.response(self._final_frame())
