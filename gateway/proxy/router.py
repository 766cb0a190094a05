"""The OpenAI-compatible routes, for inference keys only."""

from __future__ import annotations

import uuid
from functools import partial
from typing import Annotated, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from engine.openai_protocol import ChatCompletionRequest, CompletionRequest, OpenAIRequestError, parse_request
from engine.protocol import ModelList
from gateway.errors import OpenAIError
from gateway.keys.deps import InferenceKey
from gateway.limits.admission import dispatch_limited
from gateway.proxy import service
from gateway.proxy.engine_pool import EnginePool
from gateway.proxy.relay import CompletionHook

router = APIRouter(prefix="/v1", tags=["openai"])

RequestT = TypeVar("RequestT", ChatCompletionRequest, CompletionRequest)


def get_engine_pool(request: Request) -> EnginePool:
    return request.app.state.engine_pool


def get_completion_hooks(request: Request) -> list[CompletionHook]:
    """Hooks run with every finished request's outcome; other domains append to this list at start-up."""
    return request.app.state.completion_hooks


Pool = Annotated[EnginePool, Depends(get_engine_pool)]
Hooks = Annotated[list[CompletionHook], Depends(get_completion_hooks)]


async def read_request(request: Request, request_cls: type[RequestT]) -> RequestT:
    """The validated body; a bad one is a 400. Oversize bodies are refused (413) by the request middleware."""
    try:
        return parse_request(request_cls, await request.body())
    except OpenAIRequestError as exc:
        raise OpenAIError(exc.status, exc.message, param=exc.param, code=exc.code) from None


def request_id_of(request: Request) -> str:
    return getattr(request.state, "request_id", None) or uuid.uuid4().hex


@router.get("/models")
async def list_models(key: InferenceKey, pool: Pool) -> ModelList:
    return service.list_models(pool=pool, key=key)


@router.post("/chat/completions")
async def chat_completions(request: Request, key: InferenceKey, pool: Pool, hooks: Hooks) -> Response:
    openai_request = await read_request(request, ChatCompletionRequest)
    request_id = request_id_of(request)
    dispatch = partial(
        service.dispatch,
        pool=pool,
        openai_request=openai_request,
        endpoint="chat.completions",
        key=key,
        request_id=request_id,
        hooks=hooks,
    )
    # Rate limits and budgets are checked before any engine work (gateway/limits).
    return await dispatch_limited(
        request, key=key, openai_request=openai_request, request_id=request_id, dispatch=dispatch
    )


@router.post("/completions")
async def completions(request: Request, key: InferenceKey, pool: Pool, hooks: Hooks) -> Response:
    openai_request = await read_request(request, CompletionRequest)
    request_id = request_id_of(request)
    dispatch = partial(
        service.dispatch,
        pool=pool,
        openai_request=openai_request,
        endpoint="completions",
        key=key,
        request_id=request_id,
        hooks=hooks,
    )
    # Rate limits and budgets are checked before any engine work (gateway/limits).
    return await dispatch_limited(
        request, key=key, openai_request=openai_request, request_id=request_id, dispatch=dispatch
    )
