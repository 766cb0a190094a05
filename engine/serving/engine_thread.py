"""The engine's step thread: the one owner of the :class:`LLMEngine`, fed by commands.

HTTP handlers never touch the engine directly: they tokenise the request in a worker thread, send
commands (add, abort) through a thread-safe queue and receive each step's outputs on the event loop
via ``call_soon_threadsafe``, where they become frames (``frames.py``), one asyncio queue per
request. A stream that ends before its final frame aborts the request; its usage stays in the ledger.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.core.llm_engine import LLMEngine
from engine.core.outputs import ErrorKind, RequestError, RequestOutput
from engine.cpu.openmp import adopt_torch_thread_count, release_openmp_threads
from engine.loader.memory import release_freed_memory
from engine.metrics import StatsLog
from engine.serving.frames import Frame, error_frame, to_frames
from engine.serving.ledger import RequestLedger
from engine.serving.requests import engine_request
from protocol.rpc import DeltaFrame, ErrorFrame, GenerateRequest

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5


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
                tool_call_parser=engine.config.tool_call_parser,
                thinking_budget_chars=engine.config.thinking_budget_chars,
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
            if not self.engine.has_unfinished_requests():
                # Idle now: hand the heap the steps freed (activations, logits) back to the OS. The C
                # library keeps freed blocks for reuse, and after a burst of long prompts and many
                # streams that is tens of MB the process no longer uses (docs/engine.md, "Memory").
                # The same for the KV blocks the burst wrote and no one holds now.
                self.engine.release_idle_kv()
                release_freed_memory()

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
