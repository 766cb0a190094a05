"""The engine's HTTP surface: the OpenAI API, the gateway's internal RPC, health and metrics.

The :class:`LLMEngine` lives in one dedicated thread (:class:`EngineThread`) that
runs ``step()`` while there is work. HTTP handlers never touch it directly: they
tokenise the request in a worker thread, send commands (add, abort) through a
thread-safe queue and receive each step's outputs on the event loop via
``call_soon_threadsafe``, where they become frames (``frames.py``), one asyncio
queue per request. A stream that ends before its final frame (client gone, gateway cancelled or
dead) aborts the request, which frees its KV blocks at once; its usage stays in ``ledger.py``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core.llm_engine import LLMEngine
from engine.core.outputs import ErrorKind, RequestError, RequestOutput
from engine.cpu.openmp import adopt_torch_thread_count, release_openmp_threads
from engine.metrics import StatsLog
from engine.serving.frames import Frame, error_frame, to_frames
from engine.serving.ledger import RequestLedger
from engine.serving.requests import engine_request
from protocol.openai.errors import OpenAIRequestError, describe_validation_errors, error_body
from protocol.openai.requests import ChatCompletionRequest, CompletionRequest, parse_request
from protocol.openai.responses import ResponseAccumulator, StreamFormatter
from protocol.rpc import (
    ABORT_PATH,
    GENERATE_PATH,
    HEALTH_PATH,
    LEDGER_PATH,
    MODELS_PATH,
    AbortRequest,
    AbortResponse,
    DeltaFrame,
    ErrorFrame,
    FinalFrame,
    GenerateRequest,
    HealthResponse,
    Ledger,
    ModelInfo,
    ModelList,
    encode_frame,
)

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5
_DISCONNECT_POLL_S = 0.5
HTTP_STATUS = {
    ErrorKind.INVALID_REQUEST: 400,
    ErrorKind.MODEL_NOT_FOUND: 404,
    ErrorKind.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorKind.CONFLICT: 409,
}
"""The status each kind of refused request is answered with."""


class EngineThread:
    """Runs the engine loop in its own thread; the asyncio side talks to it through commands."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue[Frame]] = {}
        self._stats = StatsLog(engine.metrics)
        self.ledger = RequestLedger()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # Loading the model left this thread an OpenMP pool; with the step thread's own, libgomp would
        # manage more threads than CPUs and stop spinning at barriers (engine/cpu/openmp.py).
        release_openmp_threads()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    # -- asyncio side ---------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Frame]:
        """Tokenise and queue ``request``; raises RequestError before streaming if it is refused."""
        request_id = request.request_id
        if request_id in self._streams:
            raise RequestError(f"request id '{request_id}' is already in flight", kind=ErrorKind.CONFLICT)
        stream: asyncio.Queue[Frame] = asyncio.Queue()
        self._streams[request_id] = stream
        engine = self.engine
        try:
            core = await asyncio.to_thread(
                engine_request,
                request,
                engine.tokenizer,
                model_name=engine.model_name,
                grammars=engine.grammars,
            )
            if request.ledger_tag is not None:
                self.ledger.start(request_id, request.ledger_tag, len(core.prompt_token_ids))
            await self._call(lambda: engine.add_request(core))
        except BaseException:
            self._streams.pop(request_id, None)
            self.ledger.forget(request_id)
            raise
        return self._drain(request_id, stream)

    async def _drain(self, request_id: str, stream: asyncio.Queue[Frame]) -> AsyncIterator[Frame]:
        finished = False
        try:
            while True:
                frame = await stream.get()
                finished = not isinstance(frame, DeltaFrame)
                yield frame
                if finished:
                    return
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished:  # the consumer left early: stop generating and free the blocks
                self.submit(lambda: self._abort_left(request_id))

    def _abort_left(self, request_id: str) -> None:
        """(Engine thread.) Abort a request whose consumer left; its usage still goes to the ledger."""
        out = self.engine.abort_request(request_id)
        if out is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver_outputs, [out])

    async def abort(self, request_id: str) -> bool:
        out = await self._call(lambda: self.engine.abort_request(request_id))
        if out is not None:
            self._deliver_outputs([out])
        return out is not None

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between steps and await its result."""
        assert self._loop is not None
        future: asyncio.Future[Any] = self._loop.create_future()
        loop = self._loop

        def command() -> None:
            try:
                result = fn()
            except BaseException as exc:  # handed back to the awaiting handler
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self.submit(command)
        return await future

    def submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver_outputs(self, outputs: list[RequestOutput]) -> None:
        """Turn a step's outputs into frames (on the event loop, off the step thread) and route them."""
        for out in outputs:
            self.ledger.record(out)
            stream = self._streams.get(out.request_id)
            if stream is not None:
                for frame in to_frames(out, self.engine.tokenizer):
                    stream.put_nowait(frame)

    def _deliver_errors(self, errors: list[tuple[str, ErrorFrame]]) -> None:
        for request_id, frame in errors:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(frame)

    # -- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        adopt_torch_thread_count()  # --num-threads for this thread's kernels too (engine/cpu/openmp.py)
        while not self._stop.is_set():
            self._run_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
                self._stats.restart()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # keep serving: fail the requests in flight, free their blocks
                log.exception("engine step failed")
                errors = self._fail_all(exc)
                if errors and self._loop is not None:
                    self._loop.call_soon_threadsafe(self._deliver_errors, errors)
                continue
            if outputs and self._loop is not None:
                self._loop.call_soon_threadsafe(self._deliver_outputs, outputs)
            self._stats.maybe_log()

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _fail_all(self, exc: Exception) -> list[tuple[str, ErrorFrame]]:
        errors = []
        for request_id in list(self.engine.request_ids()):
            out = self.engine.abort_request(request_id, reason="error")
            if out is not None:
                if self._loop is not None:
                    self._loop.call_soon_threadsafe(self.ledger.record, out)
                errors.append(
                    (request_id, error_frame(f"the engine failed while generating: {exc}", out.usage))
                )
        return errors


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _error(status: int, message: str, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status=status, param=param, code=code), status_code=status)


def _request_error(exc: RequestError) -> JSONResponse:
    return _error(HTTP_STATUS[exc.kind], exc.message, param=exc.param, code=exc.code)


def create_app(engine: LLMEngine) -> FastAPI:
    """The ASGI app serving ``engine``; the step thread starts and stops with the app's lifespan."""
    worker = EngineThread(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="Tern engine", lifespan=lifespan)
    app.state.worker = worker
    model_info = ModelInfo(id=engine.model_name, max_model_len=engine.max_model_len)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error(500, "internal server error")

    # -- health, models, metrics -------------------------------------------------------------

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

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

    # -- internal RPC ------------------------------------------------------------------------

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

    # -- OpenAI API ---------------------------------------------------------------------------

    async def openai_endpoint(
        request: Request, request_cls: type[ChatCompletionRequest] | type[CompletionRequest]
    ) -> Response:
        try:
            body: ChatCompletionRequest | CompletionRequest = parse_request(request_cls, await request.body())
        except OpenAIRequestError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        request_id = uuid.uuid4().hex
        try:
            frames = await worker.generate(body.to_generate_request(request_id=request_id))
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

    return app


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
