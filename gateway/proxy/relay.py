"""One generation relayed from an engine to a client, with a cleanup path cancellation cannot skip.

:class:`BaseRelay` picks an engine and opens the generation; its subclasses speak each engine
kind's stream (``rpc_relay.Relay``: a Tern engine's NDJSON frames over ``POST /rpc/v1/generate``;
``openai_relay``: an OpenAI-compatible upstream's SSE). :class:`RelayResponse` is the ASGI
response that writes the answer to the client, as SSE chunks (one per frame, no buffering) or as
one JSON object, while watching for the client going away. Whatever happens (completion, engine
error, client disconnect, server shutdown) ``BaseRelay.finish`` runs once, shielded from
cancellation: it stops an unfinished generation on the engine, reads on for the exact token
counts, closes the upstream stream and hands a :class:`RelayOutcome` to every completion hook
(usage metering, limits settlement, metrics).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence

import aiohttp
import anyio
import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.config import EngineKind
from gateway.errors import OpenAIError
from gateway.proxy.engine_pool import EnginePool, ModelNotServed, NoHealthyEngine, Upstream
from gateway.proxy.outcome import CompletionHook, RelayOutcome, UsageJournal
from gateway.proxy.prefix_routing import PromptKeys
from protocol.openai.requests import OpenAIRequest

log = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499
"""Status recorded (never sent) when the client went away before the answer was complete."""

_JSON_REQUEST_HEADERS = {"content-type": "application/json"}


class BaseRelay:
    """The upstream side of one request, whatever the engine's kind: pick an engine, open the request
    (another engine when a connect fails), refuse in OpenAI's shape, and finish exactly once."""

    def __init__(
        self,
        *,
        pool: EnginePool,
        request_id: str,
        openai_request: OpenAIRequest,
        endpoint: str,
        tenant_id: str | None,
        key_id: str | None,
        hooks: Sequence[CompletionHook],
        journal: UsageJournal | None = None,
        cache_namespace: str | None = None,
    ) -> None:
        self.pool = pool
        self.request_id = request_id
        self.prompt = PromptKeys(openai_request, namespace=cache_namespace)
        self.openai_request = openai_request
        self.hooks = list(hooks)
        self.journal = journal
        self.outcome = RelayOutcome(
            request_id=request_id,
            endpoint=endpoint,
            model=openai_request.model,
            tenant_id=tenant_id,
            key_id=key_id,
            stream=openai_request.stream,
            started_at=time.time(),
            end_user=openai_request.user or None,
        )
        self._t0 = time.perf_counter()
        self._upstream: Upstream | None = None
        self._response: aiohttp.ClientResponse | None = None
        self._terminal = False
        """No more of the answer will be read (its last part arrived, or the stream broke)."""
        self._engine_done = False
        """The engine itself said it is finished (a last frame or event, or a refusal)."""
        self._finished = False

    # -- opening

    async def open(self) -> None:
        """Start the generation on a healthy engine; any refusal finishes the relay and raises OpenAIError."""
        try:
            await self._connect()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.finish()
            raise

    kind: EngineKind = "tern"
    """The engines this relay speaks to."""

    def _request(self, upstream: Upstream) -> tuple[str, bytes]:
        """The path and body to POST to ``upstream``."""
        raise NotImplementedError

    async def _connect(self) -> None:
        tried: list[Upstream] = []
        while True:
            upstream = self._pick(tried)
            path, body = self._request(upstream)
            upstream.inflight += 1
            try:
                response = await upstream.session.post(path, data=body, headers=_JSON_REQUEST_HEADERS)
            except BaseException as exc:
                upstream.inflight -= 1
                if not isinstance(exc, aiohttp.ClientConnectionError):
                    raise
                # No answer came back, so no generation is running there: try another engine.
                # Only a failed connect takes the engine out; a dropped keep-alive connection does not.
                if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
                    self.pool.mark_unhealthy(upstream, f"{type(exc).__name__}: {exc}")
                tried.append(upstream)
                continue
            break
        self._upstream = upstream
        self.outcome.engine_url = upstream.url
        self._response = response
        if response.status != 200:
            await self._refuse(response)

    def _pick(self, tried: list[Upstream]) -> Upstream:
        model = self.outcome.model
        try:
            return self.pool.pick(model, exclude=tried, kind=self.kind, prompt=self.prompt)
        except NoHealthyEngine:
            self._fail(503, "engine_unavailable")
            raise OpenAIError(
                503,
                "No healthy engine is available to serve this request. Try again shortly.",
                code="engine_unavailable",
                type="server_error",
            ) from None
        except ModelNotServed:
            self._fail(404, "model_not_found")
            raise OpenAIError(
                404,
                f"The model '{model}' does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            ) from None

    async def _refuse(self, response: aiohttp.ClientResponse) -> None:
        """Relay an engine's non-200 answer with its status, in OpenAI's shape."""
        raw = await response.read()
        self._terminal = self._engine_done = True
        try:
            err = orjson.loads(raw)["error"]
            message, param, code, err_type = (
                err["message"],
                err.get("param"),
                err.get("code"),
                err.get("type"),
            )
        except (ValueError, KeyError, TypeError):
            message, param, code, err_type = f"The engine answered HTTP {response.status}.", None, None, None
        code = None if code is None else str(code)  # some servers send a number here
        self._fail(response.status, code or "engine_error")
        raise OpenAIError(response.status, message, param=param, code=code, type=err_type)

    def _fail(self, status: int, code: str) -> None:
        self.outcome.status = status
        self.outcome.error_code = code
        self.outcome.finish_reason = "error"
        self.outcome.usage_exact = True  # refused before any work: nothing to bill

    # -- answering (RelayResponse calls one of these)

    async def send_stream(self, send: Send) -> None:
        """Write the SSE body (after RelayResponse sent the start), ending the response."""
        raise NotImplementedError

    async def json_answer(self) -> tuple[int, bytes]:
        """The whole answer, read to its end: status and JSON body."""
        raise NotImplementedError

    # -- finishing

    async def _stop_upstream(self) -> None:
        """The engine has not said it is finished: stop its work and learn what it produced."""

    def _settle_usage(self) -> None:
        """Last chance to fill in usage the engine did not report (before the hooks read it)."""

    async def commit(self) -> None:
        """The answer is complete: make its usage durable before its last bytes go out (once).

        Whatever the client saw complete is then billed even if this process dies a moment later.
        Answers that end otherwise (the client left, a failure) are journaled by the hooks."""
        out = self.outcome
        if out.committed or self.journal is None:
            return
        self._settle_usage()
        out.duration_s = time.perf_counter() - self._t0
        out.committed = True
        try:
            await self.journal.commit(out)
        except Exception:  # the disk failed: the usage still reaches Postgres from the buffer
            log.exception("usage journal commit failed for request %s", out.request_id)

    async def finish(self, *, client_disconnected: bool = False) -> None:
        """Run once, whatever happened. Call it shielded from cancellation."""
        if self._finished:
            return
        self._finished = True
        out = self.outcome
        try:
            if client_disconnected and not self._terminal:
                out.client_disconnected = True
                out.status = CLIENT_CLOSED_REQUEST
            if self._response is not None and not self._engine_done:
                await self._stop_upstream()
        except Exception:
            log.exception("cleanup of request %s failed", out.request_id)
        finally:
            if self._response is not None:
                self._response.close()
                self._settle_usage()
            if self._upstream is not None:
                self._upstream.inflight -= 1
            out.duration_s = time.perf_counter() - self._t0
            for hook in self.hooks:
                try:
                    await hook(out)
                except Exception:
                    log.exception("completion hook %r failed for request %s", hook, out.request_id)


_JSON_HEADERS = [(b"content-type", b"application/json")]
_STREAM_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class RelayResponse(Response):
    """Writes a relay to the client (SSE or JSON) and runs ``Relay.finish`` however it ends."""

    def __init__(self, relay: BaseRelay, *, headers: Mapping[str, str] | None = None) -> None:
        self.relay = relay
        self.stream = relay.openai_request.stream
        self.status_code = 200
        self.background = None
        extra = [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in (headers or {}).items()
        ]
        self.raw_headers = [*(_STREAM_HEADERS if self.stream else _JSON_HEADERS), *extra]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A plain asyncio task watches for the client leaving and cancels this one (an anyio task
        # group does the same with noticeably more work per request).
        writer = asyncio.current_task()
        assert writer is not None
        disconnected = False

        async def watch_for_disconnect() -> None:
            nonlocal disconnected
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            writer.cancel()

        watcher = asyncio.get_running_loop().create_task(watch_for_disconnect())
        try:
            if self.stream:
                await self._send_stream(send)
            else:
                status, payload = await self.relay.json_answer()
                # The engine is done: nothing is left for a disconnect to stop, and the answer is
                # billed whole either way. Stopped now, the watcher takes no loop turns while the
                # answer waits for its journal sync (in a burst of short answers, it often never runs).
                watcher.cancel()
                await self._send_json(send, status, payload)
        except asyncio.CancelledError:
            if not disconnected:
                raise  # cancelled from outside (shutdown): not ours to swallow
            writer.uncancel()
        except OSError:  # the server could not write: the client is gone
            disconnected = True
        finally:
            watcher.cancel()  # before any await: the watcher can no longer cancel this task
            if disconnected:  # the request envelope counts and logs it as 499, not as a 500
                scope.setdefault("state", {})["client_disconnected"] = True
            with anyio.CancelScope(shield=True):
                await self.relay.finish(client_disconnected=disconnected)

    async def _send_stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        await self.relay.send_stream(send)

    async def _send_json(self, send: Send, status: int, payload: bytes) -> None:
        await self.relay.commit()
        headers = [*self.raw_headers, (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload, "more_body": False})
