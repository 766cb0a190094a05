"""A Tern engine's generation over the RPC (``POST /rpc/v1/generate``): its NDJSON frames read,
counted for usage, and formatted as OpenAI's answers; an unfinished one is aborted and drained to its
final frame for exact usage (:class:`~gateway.proxy.relay.BaseRelay` does the rest)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import aiohttp
import anyio
import orjson
from starlette.types import Send

from gateway.errors import OpenAIError
from gateway.proxy.engine_pool import EnginePool, Upstream
from gateway.proxy.outcome import CompletionHook, TopUp, UsageJournal
from gateway.proxy.relay import BaseRelay
from protocol.openai.errors import error_body
from protocol.openai.requests import OpenAIRequest
from protocol.openai.responses import ResponseAccumulator, StreamFormatter, error_frame_body
from protocol.rpc import (
    ABORT_PATH,
    GENERATE_PATH,
    PROMPT_OVER_RESERVATION,
    PROMPT_OVER_RESERVATION_STATUS,
    AbortRequest,
    DeltaFrame,
    ErrorFrame,
    FinalFrame,
    GenerateRequest,
    parse_frame,
)

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 2.0
DRAIN_TIMEOUT_S = 5.0
"""How long the cleanup waits for the engine's final frame after an abort, for exact usage."""


class FrameStream(Protocol):
    def start(self) -> bytes: ...
    def frame(self, frame: DeltaFrame | FinalFrame | ErrorFrame) -> bytes: ...


class FrameAnswer(Protocol):
    def add(self, frame: DeltaFrame) -> None: ...
    def response(self, final: FinalFrame) -> dict[str, Any]: ...


class Relay(BaseRelay):
    """A Tern engine's generation over the RPC: NDJSON frames, formatted here as OpenAI's answers."""

    def __init__(
        self,
        *,
        pool: EnginePool,
        gen_request: GenerateRequest,
        openai_request: OpenAIRequest,
        endpoint: str,
        tenant_id: str | None,
        key_id: str | None,
        hooks: Sequence[CompletionHook],
        journal: UsageJournal | None = None,
        top_up: TopUp | None = None,
    ) -> None:
        super().__init__(
            pool=pool,
            request_id=gen_request.request_id,
            openai_request=openai_request,
            endpoint=endpoint,
            tenant_id=tenant_id,
            key_id=key_id,
            hooks=hooks,
            journal=journal,
            cache_namespace=gen_request.cache_namespace,
        )
        self.gen_request = gen_request
        if journal is not None and tenant_id is not None and key_id is not None:
            # What the engine's ledger keeps, for a successor to bill this stream if we die mid-way.
            gen_request.ledger_tag = {
                "instance": journal.instance_id,
                "tenant_id": tenant_id,
                "key_id": key_id,
                "model": openai_request.model,
                "endpoint": endpoint,
                "started_at": self.outcome.started_at,
            }
        self.top_up = top_up
        self.limit_headers: Mapping[str, str] | None = None
        """The limit headers after a top-up (None: admission's stand)."""
        self._body = gen_request.model_dump_json(exclude_none=True).encode()

    def _request(self, upstream: Upstream) -> tuple[str, bytes]:
        return GENERATE_PATH, self._body

    async def _refuse(self, response: aiohttp.ClientResponse) -> None:
        if response.status == PROMPT_OVER_RESERVATION_STATUS and self.top_up is not None:
            count = _prompt_count(await response.read())
            if count is not None and count > (self.gen_request.max_prompt_tokens or 0):
                await self._reserve_prompt(response, count)
                return
        await super()._refuse(response)

    async def _reserve_prompt(self, response: aiohttp.ClientResponse, count: int) -> None:
        """The engine counted more prompt tokens than were reserved, and did no work: reserve the
        exact count (or refuse the request, billed nothing), then send the request again."""
        assert self._upstream is not None and self.top_up is not None
        response.close()
        self._upstream.inflight -= 1
        self._upstream = self._response = None
        try:
            self.limit_headers = await self.top_up(count)
        except OpenAIError as exc:
            self._terminal = self._engine_done = True
            self._fail(exc.status, exc.code or "limit_exceeded")
            self.outcome.engine_url = None  # refused by the limits, as at admission: no usage row
            raise
        self.gen_request.max_prompt_tokens = count
        self._body = self.gen_request.model_dump_json(exclude_none=True).encode()
        await self._connect()

    # -- reading

    async def next_frame(self) -> DeltaFrame | FinalFrame | ErrorFrame | None:
        """The next frame, or None after the terminal one. A broken stream becomes an ErrorFrame."""
        if self._terminal or self._response is None:
            return None
        frame = None
        try:
            while frame is None:
                line = await self._response.content.readline()
                if not line:
                    break  # end of stream without a last frame
                if line.strip():
                    frame = parse_frame(line)
        except (aiohttp.ClientError, ValueError) as exc:
            log.warning("engine stream for %s broke: %s", self.outcome.request_id, exc)
        if frame is None:
            return self._broken()
        self._engine_done = not isinstance(frame, DeltaFrame)
        self._account(frame)
        return frame

    def _broken(self) -> ErrorFrame:
        """The stream ended without a last frame: report it, keep the tokens seen as usage."""
        out = self.outcome
        self._terminal = True
        out.finish_reason, out.error_code, out.status, out.usage_exact = (
            "error",
            "engine_stream_broken",
            502,
            False,
        )
        return ErrorFrame(
            message="The engine closed the stream before finishing the response.",
            code="engine_stream_broken",
            status=502,
            completion_tokens=out.completion_tokens,
        )

    def _account(self, frame: DeltaFrame | FinalFrame | ErrorFrame) -> None:
        out = self.outcome
        if isinstance(frame, DeltaFrame):
            if out.ttft_s is None:
                out.ttft_s = time.perf_counter() - self._t0
            out.completion_tokens += len(frame.token_ids)
            return
        self._terminal = True
        out.prompt_tokens = frame.prompt_tokens
        out.cached_tokens = frame.cached_tokens
        out.completion_tokens = frame.completion_tokens
        out.usage_exact = True
        if isinstance(frame, FinalFrame):
            out.reasoning_tokens = frame.reasoning_tokens
            out.finish_reason = frame.finish_reason
        else:
            out.finish_reason = "error"
            out.error_code = frame.code
            out.status = frame.status

    # -- answering

    def stream_formatter(self) -> FrameStream:
        """What writes the frames as the client's stream (chat or completions chunks here)."""
        return StreamFormatter(self.openai_request, request_id=self.request_id)

    def answer_builder(self) -> FrameAnswer:
        """What gathers the frames into the client's one answer."""
        return ResponseAccumulator(self.openai_request, request_id=self.request_id)

    async def send_stream(self, send: Send) -> None:
        formatter = self.stream_formatter()
        opening = formatter.start()
        if opening:
            await send({"type": "http.response.body", "body": opening, "more_body": True})
        while (frame := await self.next_frame()) is not None:
            chunk = formatter.frame(frame)
            if self._terminal:  # the last event (usage, [DONE] or the error) goes out once journaled
                await self.commit()
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def json_answer(self) -> tuple[int, bytes]:
        accumulator = self.answer_builder()
        status, body = 502, error_body("The engine sent no answer.", status=502)
        while (frame := await self.next_frame()) is not None:
            if isinstance(frame, DeltaFrame):
                accumulator.add(frame)
            elif isinstance(frame, FinalFrame):
                status, body = 200, accumulator.response(frame)
            else:
                status, body = frame.status, error_frame_body(frame)
        return status, orjson.dumps(body)

    # -- finishing

    async def _stop_upstream(self) -> None:
        """Stop the engine's work, then read on to its final frame so usage counts what it produced."""
        assert self._upstream is not None
        status = self.outcome.status
        try:
            with anyio.fail_after(ABORT_TIMEOUT_S):
                body = AbortRequest(request_id=self.outcome.request_id).model_dump_json().encode()
                async with self._upstream.session.post(
                    ABORT_PATH, data=body, headers={"content-type": "application/json"}
                ) as resp:
                    await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("abort of %s on %s failed: %s", self.outcome.request_id, self._upstream.url, exc)
        with anyio.move_on_after(DRAIN_TIMEOUT_S):
            while await self.next_frame() is not None:
                pass
        self.outcome.status = status  # the client's status, not the drained frame's


def _prompt_count(body: bytes) -> int | None:
    """The exact prompt count in an engine's ``prompt_over_reservation`` refusal (None: not one)."""
    try:
        error = orjson.loads(body)["error"]
        count = error["prompt_tokens"] if error.get("code") == PROMPT_OVER_RESERVATION else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return count if isinstance(count, int) else None
