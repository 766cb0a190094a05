"""The engine's HTTP surface: the OpenAI API, the gateway's internal RPC, health and metrics.

The :class:`LLMEngine` lives in one dedicated thread (:class:`EngineThread`,
``engine_thread.py``) that runs ``step()`` while there is work. HTTP handlers never touch it directly: they
tokenise the request in a worker thread, send commands (add, abort) through a
thread-safe queue and receive each step's outputs on the event loop via
``call_soon_threadsafe``, where they become frames (``frames.py``), one asyncio
queue per request. A stream that ends before its final frame (client gone, gateway cancelled or
dead) aborts the request, which frees its KV blocks at once; its usage stays in ``ledger.py``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core.llm_engine import LLMEngine
from engine.core.outputs import ErrorKind, RequestError
from engine.serving.engine_thread import EngineThread
from engine.serving.frames import Frame
from engine.serving.kv_publisher import start_kv_events
from engine.serving.render import add_render_routes
from protocol.openai.errors import OpenAIRequestError, describe_validation_errors, error_body
from protocol.openai.requests import ChatCompletionRequest, CompletionRequest, parse_request
from protocol.openai.responses import ResponseAccumulator, StreamFormatter
from protocol.rpc import (
    ABORT_PATH,
    GENERATE_PATH,
    HEALTH_PATH,
    LEDGER_PATH,
    MODELS_PATH,
    PROMPT_OVER_RESERVATION_STATUS,
    AbortRequest,
    AbortResponse,
    DeltaFrame,
    FinalFrame,
    GenerateRequest,
    HealthResponse,
    Ledger,
    ModelInfo,
    ModelList,
    encode_frame,
)

log = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5
HTTP_STATUS = {
    ErrorKind.INVALID_REQUEST: 400,
    ErrorKind.MODEL_NOT_FOUND: 404,
    ErrorKind.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorKind.CONFLICT: 409,
    ErrorKind.PROMPT_OVER_RESERVATION: PROMPT_OVER_RESERVATION_STATUS,
}
"""The status each kind of refused request is answered with."""


def _error(status: int, message: str, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status=status, param=param, code=code), status_code=status)


def _request_error(exc: RequestError) -> JSONResponse:
    status = HTTP_STATUS[exc.kind]
    body = error_body(exc.message, status=status, param=exc.param, code=exc.code)
    if exc.prompt_tokens is not None:  # the exact count the gateway reserves before sending it again
        body["error"]["prompt_tokens"] = exc.prompt_tokens
    return JSONResponse(body, status_code=status)


def prompt_overhead(engine: LLMEngine) -> int:
    """Tokens the chat template adds to one empty user message (0: no template, plain prompts only).
    Listing it also tells the gateway this engine checks ``max_prompt_tokens``."""
    if engine.tokenizer.chat_template is None:
        return 0
    return len(engine.tokenizer.encode_chat([{"role": "user", "content": ""}]))


def create_app(engine: LLMEngine) -> FastAPI:
    """The ASGI app serving ``engine``; the step thread starts and stops with the app's lifespan."""
    worker = EngineThread(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        publisher = start_kv_events(engine)  # before the step thread: it flushes the events
        app.state.kv_publisher = publisher
        worker.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            worker.stop()
            if publisher is not None:
                publisher.close()

    app = FastAPI(title="Tern engine", lifespan=lifespan)
    app.state.worker = worker

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error(500, "internal server error")

    _add_status_routes(app, engine, worker)
    _add_rpc_routes(app, worker)
    _add_openai_routes(app, worker)
    add_render_routes(app, engine, _request_error)
    return app


def _add_status_routes(app: FastAPI, engine: LLMEngine, worker: EngineThread) -> None:
    """Health, the served model, metrics, and the ledger of streams a gateway tagged."""
    model_info = ModelInfo(
        id=engine.model_name, max_model_len=engine.max_model_len, prompt_overhead=prompt_overhead(engine)
    )

    @app.get("/health")
    async def health() -> dict[str, object]:
        # on the C kernels, which one runs each GGML type on this CPU (ggml_kernels.serving_paths)
        return {"status": "ok", "kernels": engine.kernel_paths} if engine.kernel_paths else {"status": "ok"}

    @app.get(HEALTH_PATH)
    async def rpc_health() -> HealthResponse:
        return HealthResponse(
            status="ok",
            model=engine.model_name,
            running=engine.scheduler.num_running,
            waiting=engine.scheduler.num_waiting,
        )

    @app.get(LEDGER_PATH)
    async def rpc_ledger(instance: str) -> Ledger:
        return Ledger(entries=worker.ledger.entries(instance))

    @app.get("/v1/models")
    @app.get(MODELS_PATH)
    async def models() -> ModelList:
        return ModelList(data=[model_info])

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_rpc_routes(app: FastAPI, worker: EngineThread) -> None:
    """The gateway's internal RPC: generate (NDJSON frames) and abort."""

    @app.post(GENERATE_PATH)
    async def rpc_generate(request: Request) -> Response:
        try:
            generate = GenerateRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            message, param = describe_validation_errors(exc.errors())
            return _error(400, message, param=param)
        try:
            frames = await worker.generate(generate)
        except RequestError as exc:
            return _request_error(exc)

        async def ndjson() -> AsyncIterator[bytes]:
            async for frame in frames:
                yield encode_frame(frame)

        return StreamingResponse(ndjson(), media_type="application/x-ndjson")

    @app.post(ABORT_PATH)
    async def rpc_abort(request: Request) -> Response:
        try:
            abort = AbortRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            message, param = describe_validation_errors(exc.errors())
            return _error(400, message, param=param)
        aborted = await worker.abort(abort.request_id)
        return JSONResponse(AbortResponse(aborted=aborted).model_dump())


def _add_openai_routes(app: FastAPI, worker: EngineThread) -> None:
    """The OpenAI API, served by the engine itself (SSE or one JSON object)."""

    async def openai_endpoint(
        request: Request, request_cls: type[ChatCompletionRequest] | type[CompletionRequest]
    ) -> Response:
        try:
            body: ChatCompletionRequest | CompletionRequest = parse_request(request_cls, await request.body())
        except OpenAIRequestError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        request_id = uuid.uuid4().hex
        try:
            # A client's cache salt is its cache namespace, as vLLM's is: the gateway sends the tenant's as
            # the salt when this engine is one of its OpenAI-kind upstreams.
            gen_request = body.to_generate_request(request_id=request_id, cache_namespace=body.cache_salt)
            frames = await worker.generate(gen_request)
        except RequestError as exc:
            return _request_error(exc)
        if body.stream:
            return StreamingResponse(_sse(body, request_id, frames), media_type="text/event-stream")
        return await _collect(body, request_id, frames, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai_endpoint(request, ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai_endpoint(request, CompletionRequest)


async def _sse(
    body: ChatCompletionRequest | CompletionRequest, request_id: str, frames: AsyncIterator[Frame]
) -> AsyncIterator[bytes]:
    formatter = StreamFormatter(body, request_id=request_id)
    if start := formatter.start():
        yield start
    async for frame in frames:
        if chunk := formatter.frame(frame):
            yield chunk


async def _collect(
    body: ChatCompletionRequest | CompletionRequest,
    request_id: str,
    frames: AsyncIterator[Frame],
    request: Request,
) -> Response:
    """Gather a whole response, aborting if the client goes away while it waits."""
    accumulator = ResponseAccumulator(body, request_id=request_id)
    iterator = frames.__aiter__()
    try:
        while True:
            next_frame = asyncio.ensure_future(iterator.__anext__())
            while not next_frame.done():
                await asyncio.wait([next_frame], timeout=_DISCONNECT_POLL_S)
                if not next_frame.done() and await request.is_disconnected():
                    next_frame.cancel()  # the generator's cleanup aborts the request
                    await asyncio.wait([next_frame])
                    return Response(status_code=499)
            frame = next_frame.result()
            if isinstance(frame, DeltaFrame):
                accumulator.add(frame)
            elif isinstance(frame, FinalFrame):
                return JSONResponse(accumulator.response(frame))
            else:
                return JSONResponse(
                    error_body(frame.message, status=frame.status, code=frame.code), frame.status
                )
    finally:
        await iterator.aclose()  # type: ignore[attr-defined]
