"""``/v1/completions/render`` and ``/v1/chat/completions/render``: the prompt's token ids, as vLLM's.

A router that scores engines by the KV blocks they hold (llm-d's precise prefix-cache scorer) must
know the exact ids a request will prefill, after the chat template, to compute the block keys it looks
up. These routes answer with what ``/v1/(chat/)completions`` would prefill, through the same code
(engine/serving/requests.py), without generating: vLLM's shape, a ``GenerateRequest`` (``token_ids``,
``sampling_params``, ``model``, ...), one object for chat and a list of one per prompt for completions
(Tern takes one prompt per request). llm-d reads ``token_ids`` (and ``features`` for images, which
Tern does not take: null).

They are for the cluster's router, not for tenants: Tern's gateway does not forward them.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.core.llm_engine import LLMEngine
from engine.core.outputs import RequestError
from engine.serving.requests import check_model, tokenize
from protocol.openai.errors import OpenAIRequestError
from protocol.openai.requests import ChatCompletionRequest, CompletionRequest, parse_request
from protocol.rpc import GenerateRequest

COMPLETIONS_RENDER_PATH = "/v1/completions/render"
CHAT_RENDER_PATH = "/v1/chat/completions/render"


def render_token_ids(request: GenerateRequest, engine: LLMEngine) -> list[int]:
    """The ids the engine would prefill for ``request`` (the model is checked first, as there)."""
    check_model(request, engine.model_name)
    return tokenize(request, engine.tokenizer)


def rendered(request: GenerateRequest, token_ids: list[int], *, model: str, stream: bool) -> dict[str, Any]:
    """vLLM's ``GenerateRequest`` for one prompt."""
    return {
        "request_id": request.request_id,
        "token_ids": token_ids,
        "features": None,
        "sampling_params": request.sampling.model_dump(mode="json"),
        "model": model,
        "stream": stream,
        "stream_options": None,
        "cache_salt": request.cache_namespace,
        "priority": 0,
        "kv_transfer_params": None,
    }


def add_render_routes(
    app: FastAPI, engine: LLMEngine, request_error: Callable[[RequestError], JSONResponse]
) -> None:
    """The two render routes; ``request_error`` answers a refused request as the server's others do."""

    async def render(
        request: Request, request_cls: type[ChatCompletionRequest] | type[CompletionRequest]
    ) -> dict[str, Any] | Response:
        try:
            body: ChatCompletionRequest | CompletionRequest = parse_request(request_cls, await request.body())
        except OpenAIRequestError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        generate = body.to_generate_request(request_id=f"render-{uuid.uuid4().hex}")
        try:
            token_ids = await asyncio.to_thread(render_token_ids, generate, engine)
        except RequestError as exc:
            return request_error(exc)
        return rendered(generate, token_ids, model=engine.model_name, stream=bool(body.stream))

    @app.post(CHAT_RENDER_PATH)
    async def chat_render(request: Request) -> Response:
        result = await render(request, ChatCompletionRequest)
        return result if isinstance(result, Response) else JSONResponse(result)

    @app.post(COMPLETIONS_RENDER_PATH)
    async def completions_render(request: Request) -> Response:
        result = await render(request, CompletionRequest)
        return result if isinstance(result, Response) else JSONResponse([result])
