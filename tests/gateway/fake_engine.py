"""A stand-in engine for the gateway's own tests: a real HTTP server speaking protocol/rpc.py.

It answers deterministically (the words of ``REPLY``, one token each, cut at
``max_tokens``), records what it received, aborted and lost, and has switches
for the failure modes the proxy must handle. End-to-end tests use the real
engine instead.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

from live_server import ServedApp, free_port
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from protocol.openai.errors import error_body
from protocol.rpc import (
    ABORT_PATH,
    GENERATE_PATH,
    HEALTH_PATH,
    MODELS_PATH,
    PROMPT_OVER_RESERVATION,
    PROMPT_OVER_RESERVATION_STATUS,
    AbortRequest,
    DeltaFrame,
    ErrorFrame,
    FinalFrame,
    GenerateRequest,
    HealthResponse,
    ModelInfo,
    ModelList,
    encode_frame,
)

REPLY = ["Hello", " from", " the", " fake", " engine", "."]

Mode = Literal["ok", "error_status", "error_midstream", "truncate", "context_length"]
"""truncate: end the stream after two deltas with no last frame, like an engine that died."""


def prompt_token_count(req: GenerateRequest) -> int:
    """One token per whitespace-separated word of the prompt (or of every message)."""
    if req.prompt is not None:
        return len(req.prompt) if isinstance(req.prompt, list) else len(req.prompt.split())
    return sum(len(str(m.content or "").split()) for m in req.messages or [])


@dataclass
class FakeEngine(ServedApp):
    model: str = "fake-model"
    mode: Mode = "ok"
    healthy: bool = True
    token_delay_s: float = 0.0
    gate: threading.Event | None = None
    """When set, the stream pauses after its first delta until the test sets the event."""
    received: list[GenerateRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    disconnected: list[str] = field(default_factory=list)
    """Request ids whose generate stream was closed by the caller before its last frame."""
    finished: list[str] = field(default_factory=list)
    over_reserved: list[str] = field(default_factory=list)
    """Request ids refused for a prompt over ``max_prompt_tokens`` (the gateway then tops up)."""
    health_checks: int = 0
    generate_called: threading.Event = field(default_factory=threading.Event)
    port: int = field(default_factory=free_port)
    metrics_text: str = ""
    """What ``GET /metrics`` answers (Prometheus text)."""

    def __post_init__(self) -> None:
        self._abort_flags: dict[str, asyncio.Event] = {}
        self.app = Starlette(
            routes=[
                Route(GENERATE_PATH, self._generate, methods=["POST"]),
                Route(ABORT_PATH, self._abort, methods=["POST"]),
                Route(HEALTH_PATH, self._health, methods=["GET"]),
                Route(MODELS_PATH, self._models, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
            ]
        )

    # -- handlers

    async def _health(self, _: Request) -> Response:
        self.health_checks += 1
        if not self.healthy:
            return JSONResponse(HealthResponse(status="loading").model_dump(), status_code=503)
        return JSONResponse(HealthResponse(status="ok", model=self.model).model_dump())

    async def _models(self, _: Request) -> Response:
        info = ModelInfo(id=self.model, max_model_len=2048, prompt_overhead=0)  # checks max_prompt_tokens
        return JSONResponse(ModelList(data=[info]).model_dump())

    async def _metrics(self, _: Request) -> Response:
        return Response(self.metrics_text, media_type="text/plain; version=0.0.4")

    async def _abort(self, request: Request) -> Response:
        body = AbortRequest.model_validate_json(await request.body())
        self.aborted.append(body.request_id)
        flag = self._abort_flags.get(body.request_id)
        if flag is not None:
            flag.set()
        return JSONResponse({"aborted": flag is not None})

    async def _generate(self, request: Request) -> Response:
        req = GenerateRequest.model_validate_json(await request.body())
        prompt_tokens = prompt_token_count(req)
        if req.max_prompt_tokens is not None and prompt_tokens > req.max_prompt_tokens:
            # As the real engine: refused before any work, with the exact count (not "received").
            self.over_reserved.append(req.request_id)
            body = error_body("over", status=PROMPT_OVER_RESERVATION_STATUS, code=PROMPT_OVER_RESERVATION)
            body["error"]["prompt_tokens"] = prompt_tokens
            return JSONResponse(body, status_code=PROMPT_OVER_RESERVATION_STATUS)
        self.received.append(req)
        self.generate_called.set()
        if req.model not in (None, self.model):
            body = error_body(f"The model '{req.model}' does not exist.", status=404, code="model_not_found")
            return JSONResponse(body, status_code=404)
        if self.mode == "context_length":
            body = error_body(
                "This model's maximum context length is 2048 tokens.",
                status=400,
                code="context_length_exceeded",
            )
            return JSONResponse(body, status_code=400)
        if self.mode == "error_status":
            return JSONResponse(error_body("engine exploded", status=500), status_code=500)
        self._abort_flags[req.request_id] = asyncio.Event()
        return StreamingResponse(self._frames(req), media_type="application/x-ndjson")

    @staticmethod
    async def _wait_for_gate(gate: threading.Event, abort: asyncio.Event) -> None:
        """Wait until the test opens the gate or the request is aborted."""
        waiters = {
            asyncio.ensure_future(asyncio.to_thread(gate.wait, 30)),
            asyncio.ensure_future(abort.wait()),
        }
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def _frames(self, req: GenerateRequest) -> AsyncIterator[bytes]:
        abort = self._abort_flags[req.request_id]
        max_tokens = req.sampling.max_tokens
        truncated = max_tokens is not None and max_tokens < len(REPLY)
        words = REPLY[:max_tokens] if truncated else REPLY
        produced = 0
        complete = False
        try:
            for i, word in enumerate(words):
                if abort.is_set():
                    break
                reason = ("length" if truncated else "stop") if i == len(words) - 1 else None
                for index in range(req.sampling.n):
                    yield encode_frame(
                        DeltaFrame(index=index, text=word, token_ids=[i], finish_reason=reason)
                    )
                    produced += 1
                if i == 0 and self.gate is not None:
                    await self._wait_for_gate(self.gate, abort)
                if i == 1 and self.mode == "truncate":
                    return
                if i == 1 and self.mode == "error_midstream":
                    yield encode_frame(
                        ErrorFrame(message="engine failed mid-stream", completion_tokens=produced)
                    )
                    complete = True
                    return
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
            reason = "abort" if abort.is_set() else ("length" if truncated else "stop")
            yield encode_frame(
                FinalFrame(
                    finish_reason=reason,
                    finish_reasons=[reason] * req.sampling.n,
                    prompt_tokens=prompt_token_count(req),
                    completion_tokens=produced,
                )
            )
            complete = True
        finally:
            self._abort_flags.pop(req.request_id, None)
            (self.finished if complete else self.disconnected).append(req.request_id)
