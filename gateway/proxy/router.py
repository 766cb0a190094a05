"""The OpenAI-compatible routes, for inference keys only.

``GET /v1/models`` is an ordinary FastAPI route. The two generation routes are the gateway's hot
path, so they are plain ASGI endpoints (:class:`GenerateEndpoint`) that the app serves on its
direct lane (``gateway.app.GatewayApp``), without FastAPI's middleware stack, routing and
dependency solving. They do the same checks, in the same order, with the same errors.
"""

from __future__ import annotations

from typing import Annotated, Protocol

from fastapi import APIRouter, Depends, Request
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.auth.deps import InferenceKey, authenticate_kind
from gateway.config import Settings
from gateway.errors import OpenAIError
from gateway.proxy import service
from gateway.proxy.engine_pool import EnginePool
from gateway.proxy.outcome import Admitted, Admitter, CompletionHook, UsageJournal
from gateway.proxy.relay import RelayResponse
from protocol.openai.errors import OpenAIRequestError
from protocol.openai.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
    RequestT,
    parse_request,
)
from protocol.openai.responses_request import ResponsesRequest, parse_responses_request
from protocol.rpc import ModelList

router = APIRouter(prefix="/v1", tags=["openai"])


class ProxyState(Protocol):
    """What the /v1 routes read from the app's state (``gateway.wiring.GatewayState``)."""

    settings: Settings
    engine_pool: EnginePool
    completion_hooks: list[CompletionHook]
    """Run with every finished request's outcome (limits settlement, usage metering)."""
    usage_journal: UsageJournal | None
    """Makes a complete answer's usage durable before its last bytes."""

    @property
    def admitter(self) -> Admitter | None: ...


def proxy_state(scope: Scope) -> ProxyState:
    return scope["app"].state.gateway


async def get_engine_pool(request: Request) -> EnginePool:
    """``async`` so FastAPI calls it on the loop: a plain ``def`` dependency costs a thread hop."""
    return proxy_state(request.scope).engine_pool


Pool = Annotated[EnginePool, Depends(get_engine_pool)]


@router.get("/models")
async def list_models(key: InferenceKey, pool: Pool) -> ModelList:
    return service.list_models(pool=pool, key=key)


async def read_body(receive: Receive) -> bytes:
    """The whole request body. Its size is limited by the request envelope (``gateway.ops.middleware``)."""
    chunks: list[bytes] = []
    more_body = True
    while more_body:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect
        chunks.append(message.get("body", b""))
        more_body = message.get("more_body", False)
    return b"".join(chunks)


def read_request(request_cls: type[RequestT], body: bytes) -> RequestT:
    """The validated body; a bad one is a 400."""
    try:
        return parse_request(request_cls, body)
    except OpenAIRequestError as exc:
        raise OpenAIError(exc.status, exc.message, param=exc.param, code=exc.code) from None


class GenerateEndpoint:
    """``POST /v1/chat/completions`` or ``POST /v1/completions``, as a plain ASGI app."""

    def __init__(
        self, request_cls: type[ChatCompletionRequest] | type[CompletionRequest], endpoint: str
    ) -> None:
        self.request_cls = request_cls
        self.endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            response = await self.generate(scope, receive)
        except OpenAIError as exc:
            response = exc.response()
        except HTTPException as exc:  # 413: a chunked body over the limit (the request envelope)
            response = OpenAIError(exc.status_code, str(exc.detail)).response()
        await response(scope, receive, send)

    def read(self, raw_body: bytes) -> tuple[OpenAIRequest, ResponsesRequest | None]:
        """The validated request, in the form the engines take, and the Responses request it came as."""
        if self.request_cls is ChatCompletionRequest:
            return read_request(ChatCompletionRequest, raw_body), None
        return read_request(CompletionRequest, raw_body), None

    async def generate(self, scope: Scope, receive: Receive) -> Response:
        """Authenticate, validate, check the key's model scope, admit under the limits, then dispatch."""
        key = await authenticate_kind(scope, "inference")
        raw_body = await read_body(receive)
        openai_request, responses_request = self.read(raw_body)
        # Before the limits, so a refused model costs no quota.
        service.ensure_model_allowed(key=key, model=openai_request.model)
        state = proxy_state(scope)
        request_id: str = scope["state"]["request_id"]
        cache_namespace = service.prefix_cache_namespace(
            key=key, isolation=state.settings.prefix_cache_isolation, salt=openai_request.cache_salt
        )

        async def dispatch(admitted: Admitted) -> RelayResponse:
            return await service.dispatch(
                pool=state.engine_pool,
                openai_request=openai_request,
                raw_body=raw_body,
                endpoint=self.endpoint,
                key=key,
                request_id=request_id,
                cache_namespace=cache_namespace,
                hooks=state.completion_hooks,
                journal=state.usage_journal,
                admitted=admitted,
                responses_request=responses_request,
            )

        # Rate limits and budgets are checked before any engine work (gateway/limits).
        return await service.admit_and_dispatch(
            state.admitter,
            key=key,
            openai_request=openai_request,
            request_id=request_id,
            dispatch=dispatch,
            pool=state.engine_pool,
        )


class ResponsesEndpoint(GenerateEndpoint):
    """``POST /v1/responses``: the chat generation it amounts to, answered in the Responses shape."""

    def __init__(self) -> None:
        super().__init__(ChatCompletionRequest, "responses")

    def read(self, raw_body: bytes) -> tuple[OpenAIRequest, ResponsesRequest | None]:
        try:
            responses_request = parse_responses_request(raw_body)
            return responses_request.to_chat(), responses_request
        except OpenAIRequestError as exc:
            raise OpenAIError(exc.status, exc.message, param=exc.param, code=exc.code) from None


generate_routes = [
    Route(
        "/v1/chat/completions", GenerateEndpoint(ChatCompletionRequest, "chat.completions"), methods=["POST"]
    ),
    Route("/v1/completions", GenerateEndpoint(CompletionRequest, "completions"), methods=["POST"]),
    Route("/v1/responses", ResponsesEndpoint(), methods=["POST"]),
]
"""For ``GatewayApp.add_direct_route``."""
