"""A stand-in OpenAI-compatible server (what vLLM, SGLang or llama.cpp serve) on a real port.

It answers the words of ``REPLY`` (one SSE event each), reports usage as a real server would (or
not at all, with ``report_usage=False``), records the requests and headers it received and the
streams its caller closed early. End-to-end tests use Tern's real engine's ``/v1`` instead.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from live_server import ServedApp, free_port
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

REPLY = ["Hello", " from", " the", " upstream", "."]


def prompt_words(body: dict[str, Any]) -> int:
    if "prompt" in body:
        return len(str(body["prompt"]).split())
    return sum(len(str(m.get("content") or "").split()) for m in body["messages"])


@dataclass
class FakeOpenAIEngine(ServedApp):
    model: str = "upstream-model"
    report_usage: bool = True
    cached_tokens: int = 0
    health_status: int | None = 200
    """What ``GET /health`` answers; None: the server has no such route (404)."""
    require_key: str | None = None
    fail_with: int | None = None
    """When set, generation requests are refused with this status and an OpenAI error body."""
    gate: threading.Event | None = None
    """When given, a stream pauses after its first event until the test sets it."""
    prompt_overhead: int | None = 7
    """Listed in ``/v1/models`` as Tern's own ``/v1`` lists it; None: not listed (as vLLM), so the
    gateway measures it with one request of an empty message."""
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    closed_early: list[int] = field(default_factory=list)
    """For each stream its caller closed before the end: the events sent until then."""
    finished: threading.Event = field(default_factory=threading.Event)
    """Set when a stream ends, either way."""
    port: int = field(default_factory=free_port)

    def __post_init__(self) -> None:
        self.app = Starlette(
            routes=[
                Route("/health", self._health, methods=["GET"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/chat/completions", self._generate, methods=["POST"]),
                Route("/v1/completions", self._generate, methods=["POST"]),
            ]
        )

    def _refused(self, request: Request) -> Response | None:
        if self.require_key and request.headers.get("authorization") != f"Bearer {self.require_key}":
            return JSONResponse({"error": {"message": "bad key", "code": "invalid_api_key"}}, 401)
        return None

    async def _health(self, request: Request) -> Response:
        if self.health_status is None:
            return Response(status_code=404)
        return Response(status_code=self.health_status)

    async def _models(self, request: Request) -> Response:
        if refused := self._refused(request):
            return refused
        data: list[dict[str, Any]] = [
            {"id": self.model, "object": "model", "created": 1, "owned_by": "someone"}
        ]
        if self.prompt_overhead is not None:
            data[0]["prompt_overhead"] = self.prompt_overhead
        return JSONResponse({"object": "list", "data": data})

    def _usage(self, body: dict[str, Any], completion: int) -> dict[str, Any]:
        prompt = prompt_words(body)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    async def _generate(self, request: Request) -> Response:
        if refused := self._refused(request):
            return refused
        body = orjson.loads(await request.body())
        self.received.append(body)
        self.headers.append(dict(request.headers))
        if self.fail_with is not None:
            error = {"message": "The engine refuses.", "type": "invalid_request_error", "code": "refused"}
            return JSONResponse({"error": error}, status_code=self.fail_with)
        if body["model"] != self.model:
            error = {"message": f"The model `{body['model']}` does not exist.", "code": 404}
            return JSONResponse({"error": error, "object": "error"}, status_code=404)
        words = REPLY[: body.get("max_tokens") or body.get("max_completion_tokens") or len(REPLY)]
        chat = "messages" in body
        if body.get("stream"):
            return StreamingResponse(self._events(body, words, chat), media_type="text/event-stream")
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "logprobs": None}
        choice |= (
            {"message": {"role": "assistant", "content": "".join(words)}}
            if chat
            else {"text": "".join(words)}
        )
        answer = {
            "id": "upstream-id",
            "object": "chat.completion" if chat else "text_completion",
            "created": 1,
            "model": self.model,
            "choices": [choice],
        }
        if self.report_usage:
            answer["usage"] = self._usage(body, len(words))
        return JSONResponse(answer)

    async def _events(self, body: dict[str, Any], words: list[str], chat: bool) -> AsyncIterator[bytes]:
        sent = 0
        complete = False
        base = {"id": "upstream-id", "object": "chat.completion.chunk" if chat else "text_completion"}
        base |= {"created": 1, "model": self.model}
        try:
            yield b": keep-alive\n\n"
            for i, word in enumerate(words):
                reason = "stop" if i == len(words) - 1 else None
                part = {"delta": {"content": word}} if chat else {"text": word}
                event = base | {"choices": [{"index": 0, **part, "finish_reason": reason}]}
                yield b"data: " + orjson.dumps(event) + b"\n\n"
                sent += 1
                if i == 0 and self.gate is not None:
                    await asyncio.to_thread(self.gate.wait, 30)
            wants_usage = (body.get("stream_options") or {}).get("include_usage")
            if self.report_usage and wants_usage:
                event = base | {"choices": [], "usage": self._usage(body, len(words))}
                yield b"data: " + orjson.dumps(event) + b"\n\n"
            yield b"data: [DONE]\n\n"
            complete = True
        finally:
            if not complete:
                self.closed_early.append(sent)
            self.finished.set()
