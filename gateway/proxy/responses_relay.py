"""``/v1/responses`` relayed from a Tern engine: the chat generation, answered in the Responses shape.

The engine runs the chat request the Responses request amounts to
(``ResponsesRequest.to_chat``); this relay only writes its frames as a ``response`` object or as
the Responses API's events (``protocol/openai/responses_events.py``). Opening, aborting, usage and
the completion hooks are :class:`~gateway.proxy.rpc_relay.Relay`'s, unchanged: billed like chat.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.types import Send

from gateway.proxy.rpc_relay import Relay
from protocol.openai.errors import error_body
from protocol.openai.responses import error_frame_body
from protocol.openai.responses_events import ResponseBuilder, ResponsesStream
from protocol.openai.responses_request import ResponsesRequest
from protocol.rpc import DeltaFrame, FinalFrame


class ResponsesRelay(Relay):
    def __init__(self, *, responses_request: ResponsesRequest, **relay: Any) -> None:
        super().__init__(**relay)
        self.responses_request = responses_request

    async def send_stream(self, send: Send) -> None:
        events = ResponsesStream(self.responses_request, request_id=self.request_id)
        await send({"type": "http.response.body", "body": events.start(), "more_body": True})
        while (frame := await self.next_frame()) is not None:
            chunk = events.frame(frame)
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def json_answer(self) -> tuple[int, bytes]:
        builder = ResponseBuilder(self.responses_request, request_id=self.request_id)
        status, body = 502, error_body("The engine sent no answer.", status=502)
        while (frame := await self.next_frame()) is not None:
            if isinstance(frame, DeltaFrame):
                builder.add(frame)
            elif isinstance(frame, FinalFrame):
                status, body = 200, builder.final(frame)
            else:
                status, body = frame.status, error_frame_body(frame)
        return status, orjson.dumps(body)
