"""One request relayed to an ``openai``-kind engine (vLLM, SGLang, llama.cpp, Tern's own ``/v1``).

The client's validated request is forwarded as it came, with three changes: the model gets its
upstream name (``TERN_ENGINE_MODEL_MAP``), ``max_tokens`` is capped as the limits admitted it, and
a stream asks for usage (``stream_options.include_usage``) so metering has the engine's own
counts. Answers are relayed as they are, event by event, with the gateway's response id (and the
served model name); the usage event is dropped when the client did not ask for it.

Usage is what the engine reported, ``prompt_tokens_details.cached_tokens`` included. When it
reported none (an old server, a broken stream, a client that went away: closing the stream is the
only abort an OpenAI server knows) the gateway counts what it saw (:mod:`gateway.proxy.token_count`)
and the usage row is marked estimated.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import aiohttp
import orjson
from starlette.types import Send

from gateway.proxy.engine_pool import EnginePool, Upstream
from gateway.proxy.outcome import CUT_BY_GATEWAY_STATUS, CompletionHook, RelayOutcome, UsageJournal
from gateway.proxy.relay import BaseRelay
from gateway.proxy.token_count import TokenCounter, prompt_text
from protocol.openai.errors import error_body
from protocol.openai.requests import ChatCompletionRequest, OpenAIRequest
from protocol.openai.responses import SSE_DONE, sse_event

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
PROGRESS_INTERVAL_S = 0.5
"""How often a stream's usage so far is journaled (such an engine keeps no ledger to ask after a
gateway crash); also once at its first text."""


class OpenAIRelay(BaseRelay):
    """Forward one OpenAI request, relay its answer with the gateway's id, meter its usage."""

    kind = "openai"

    def __init__(
        self,
        *,
        pool: EnginePool,
        body: dict[str, Any],
        request_id: str,
        openai_request: OpenAIRequest,
        endpoint: str,
        tenant_id: str | None,
        key_id: str | None,
        hooks: Sequence[CompletionHook],
        token_counter: TokenCounter,
        journal: UsageJournal | None = None,
        cache_namespace: str | None = None,
    ) -> None:
        super().__init__(
            pool=pool,
            request_id=request_id,
            openai_request=openai_request,
            endpoint=endpoint,
            tenant_id=tenant_id,
            key_id=key_id,
            hooks=hooks,
            journal=journal,
            cache_namespace=cache_namespace,
        )
        self.is_chat = isinstance(openai_request, ChatCompletionRequest)
        self.response_id = f"chatcmpl-{request_id}" if self.is_chat else f"cmpl-{request_id}"
        self.served_model = openai_request.model
        self.upstream_model = pool.model_names.upstream(openai_request.model)
        self.token_counter = token_counter
        self.client_wants_usage = openai_request.include_usage
        if openai_request.stream:
            body["stream_options"] = {"include_usage": True}
        body["model"] = self.upstream_model
        self._body = orjson.dumps(body)
        self._request_body = body
        self._texts: list[str] = []
        """Generated text as it passed through, for counting when the engine reports no usage."""
        self._content_events = 0
        self._reported_usage = False
        self._next_progress_at = 0.0
        self._prompt_estimate: int | None = None

    def _request(self, upstream: Upstream) -> tuple[str, bytes]:
        return (CHAT_PATH if self.is_chat else COMPLETIONS_PATH), self._body

    # -- reading the answer

    def _rewrite(self, event: dict[str, Any]) -> None:
        """The gateway's id and served model name on an event or answer; take its usage and text."""
        if "id" in event:
            event["id"] = self.response_id
        if "model" in event and event["model"] == self.upstream_model:
            event["model"] = self.served_model
        usage = event.get("usage")
        if isinstance(usage, dict):
            self._take_usage(usage)
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            part = choice.get("delta") or choice.get("message") or {}
            text = part.get("content") if self.is_chat and isinstance(part, dict) else choice.get("text")
            if isinstance(text, str) and text:
                self._texts.append(text)
                self._content_events += 1
            if choice.get("finish_reason"):
                self.outcome.finish_reason = str(choice["finish_reason"])

    def _take_usage(self, usage: dict[str, Any]) -> None:
        out = self.outcome
        try:
            prompt, completion = int(usage["prompt_tokens"]), int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
            done = usage.get("completion_tokens_details") or {}
            reasoning = int(done.get("reasoning_tokens") or 0) if isinstance(done, dict) else 0
        except (KeyError, TypeError, ValueError):
            return  # not usage we can read: counted as if there were none
        out.prompt_tokens, out.completion_tokens, out.cached_tokens = prompt, completion, min(cached, prompt)
        out.reasoning_tokens = min(reasoning, completion)
        out.usage_exact = self._reported_usage = True

    def _error_event(self, event: dict[str, Any]) -> None:
        error = event.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        self.outcome.status = 502
        self.outcome.error_code = str(code) if code else "engine_error"
        self.outcome.finish_reason = "error"

    # The answer's shape: as the engine sent it (chat or completions). ``/v1/responses`` writes its
    # own (gateway/proxy/responses_relay.py) from the same events.

    def _stream_opening(self) -> bytes:
        return b""

    def _stream_done(self) -> bytes:
        return SSE_DONE

    def _format_event(self, event: dict[str, Any]) -> bytes:
        return sse_event(event)

    def _format_answer(self, answer: dict[str, Any]) -> dict[str, Any]:
        return answer

    async def send_stream(self, send: Send) -> None:
        assert self._response is not None
        content = self._response.content
        data: list[bytes] = []
        if opening := self._stream_opening():
            await send({"type": "http.response.body", "body": opening, "more_body": True})
        try:
            while True:
                line = await content.readline()
                if not line:
                    break  # the stream ended without [DONE]
                line = line.rstrip(b"\r\n")
                if line.startswith(b"data:"):
                    data.append(line[5:].lstrip())
                    continue
                if line or not data:
                    continue  # a comment (keep-alive), another field, or a blank line between events
                payload, data = b"\n".join(data), []
                if payload == b"[DONE]":
                    self._terminal = self._engine_done = True
                    await self.commit()
                    await send({"type": "http.response.body", "body": self._stream_done(), "more_body": True})
                    break
                chunk = self._relay_event(payload)
                if self._reported_usage:  # the engine's usage: the answer is complete
                    await self.commit()
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (aiohttp.ClientError, ValueError) as exc:
            log.warning("engine stream for %s broke: %s", self.request_id, exc)
        if not self._terminal:
            self._terminal = True
            # usage was the last thing to come: the engine finished; else say the stream broke
            tail = b"" if self._reported_usage else self._broken()
            await self.commit()
            if tail:
                await send({"type": "http.response.body", "body": tail, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _relay_event(self, payload: bytes) -> bytes:
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            log.warning("engine sent an event that is not JSON for %s", self.request_id)
            return b""
        if not isinstance(event, dict):
            return b""
        if "error" in event:
            self._error_event(event)
            return self._format_event(event)
        if self.outcome.ttft_s is None and event.get("choices"):
            self.outcome.ttft_s = time.perf_counter() - self._t0
        self._rewrite(event)
        if self.journal is not None and self._content_events and not self._reported_usage:
            now = time.monotonic()
            if now >= self._next_progress_at:
                self._next_progress_at = now + PROGRESS_INTERVAL_S
                self.journal.progress(self._progress())
        if not self.client_wants_usage and "usage" in event:
            del event["usage"]
            if not event.get("choices"):
                return b""  # the usage event the gateway asked for, not the client
        return self._format_event(event)

    def _broken(self) -> bytes:
        out = self.outcome
        out.status, out.error_code, out.finish_reason = 502, "engine_stream_broken", "error"
        body = error_body(
            "The engine closed the stream before finishing the response.", status=502, code=out.error_code
        )
        return sse_event(body) + SSE_DONE

    async def json_answer(self) -> tuple[int, bytes]:
        assert self._response is not None
        try:
            raw = await self._response.read()
            answer = orjson.loads(raw)
        except (aiohttp.ClientError, ValueError) as exc:
            log.warning("engine answer for %s unreadable: %s", self.request_id, exc)
            answer = None
        self._terminal = self._engine_done = True
        if not isinstance(answer, dict) or "error" in answer:
            self.outcome.status, self.outcome.error_code = 502, "engine_bad_answer"
            if isinstance(answer, dict):
                self._error_event(answer)
            return 502, orjson.dumps(error_body("The engine sent no usable answer.", status=502))
        self._rewrite(answer)
        return 200, orjson.dumps(self._format_answer(answer))

    # -- finishing

    def _progress(self) -> RelayOutcome:
        """What the stream has used so far, counted here, as billed if the gateway dies now."""
        out = replace(self.outcome, status=CUT_BY_GATEWAY_STATUS, finish_reason="error")
        self._count_usage(out)
        out.duration_s = time.perf_counter() - self._t0
        return out

    def _settle_usage(self) -> None:
        """Count what the engine did not report: the prompt, and the text that passed through."""
        if not self.outcome.usage_exact:
            self._count_usage(self.outcome)

    def _count_usage(self, out: RelayOutcome) -> None:
        model, counter = self.served_model, self.token_counter
        if self._prompt_estimate is None:
            text, prompt_ids = prompt_text(self._request_body)
            self._prompt_estimate = prompt_ids + counter.count(model, text)
        out.prompt_tokens = self._prompt_estimate
        out.cached_tokens = 0
        out.usage_exact = False
        if self.openai_request.stream and not counter.has_tokenizer(model):
            out.completion_tokens = self._content_events  # streaming servers send a token per event
        else:
            out.completion_tokens = counter.count(model, "".join(self._texts))
