"""The OpenAI-compatible routes, for inference keys only."""

from __future__ import annotations

from functools import partial
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from engine.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequestError,
    RequestT,
    parse_request,
)
from engine.protocol import ModelList
from gateway.errors import OpenAIError
from gateway.keys.deps import AuthenticatedKey, InferenceKey
from gateway.limits.admission import dispatch_limited
from gateway.proxy import service
from gateway.proxy.engine_pool import EnginePool

router = APIRouter(prefix="/v1", tags=["openai"])


async def get_engine_pool(request: Request) -> EnginePool:
    """``async`` so FastAPI calls it on the loop: a plain ``def`` dependency costs a thread hop."""
    return request.app.state.engine_pool


Pool = Annotated[EnginePool, Depends(get_engine_pool)]


async def read_request(request: Request, request_cls: type[RequestT]) -> RequestT:
    """The validated body; a bad one is a 400. Oversize bodies are refused (413) by the request middleware."""
    try:
        return parse_request(request_cls, await request.body())
    except OpenAIRequestError as exc:
        raise OpenAIError(exc.status, exc.message, param=exc.param, code=exc.code) from None


@router.get("/models")
async def list_models(key: InferenceKey, pool: Pool) -> ModelList:
    return service.list_models(pool=pool, key=key)


@router.post("/chat/completions")
async def chat_completions(request: Request, key: InferenceKey) -> Response:
    return await generate(request, key=key, request_cls=ChatCompletionRequest, endpoint="chat.completions")


@router.post("/completions")
async def completions(request: Request, key: InferenceKey) -> Response:
    return await generate(request, key=key, request_cls=CompletionRequest, endpoint="completions")


async def generate(
    request: Request,
    *,
    key: AuthenticatedKey,
    request_cls: type[ChatCompletionRequest] | type[CompletionRequest],
    endpoint: str,
) -> Response:
    """Validate, check the key's model scope, admit under the limits, then dispatch to an engine."""
    openai_request = await read_request(request, request_cls)
    # Before the limits, so a refused model costs no quota.
    service.ensure_model_allowed(key=key, model=openai_request.model)
    request_id: str = request.state.request_id
    state = request.app.state
    dispatch = partial(
        service.dispatch,
        pool=state.engine_pool,
        openai_request=openai_request,
        endpoint=endpoint,
        key=key,
        request_id=request_id,
        # Run with the finished request's RelayOutcome; other domains add theirs at start-up.
        hooks=state.completion_hooks,
    )
    # Rate limits and budgets are checked before any engine work (gateway/limits).
    return await dispatch_limited(
        request, key=key, openai_request=openai_request, request_id=request_id, dispatch=dispatch
    )
