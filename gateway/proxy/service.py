"""What the /v1 routes do: check the key's model scope, dispatch to an engine, list models."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
import orjson

from gateway.auth.identity import AuthenticatedKey
from gateway.config import PrefixCacheIsolation
from gateway.errors import OpenAIError
from gateway.metrics import upstream_latency_by, upstream_ttft_by
from gateway.proxy.engine_pool import EnginePool
from gateway.proxy.openai_relay import OpenAIRelay
from gateway.proxy.outcome import Admitted, Admitter, CompletionHook, PromptSize, RelayOutcome, UsageJournal
from gateway.proxy.relay import BaseRelay, RelayResponse
from gateway.proxy.responses_relay import ResponsesOpenAIRelay, ResponsesRelay
from gateway.proxy.rpc_relay import Relay
from protocol.openai.requests import OpenAIRequest
from protocol.openai.responses_request import ResponsesRequest
from protocol.rpc import ModelList

T = TypeVar("T")

UNMEASURED_OVERHEAD = 1024
"""The template tokens assumed for an ``openai`` engine's model whose overhead could not be measured
yet (``EnginePool._measure_overhead``): generous, so the bound stays an upper bound."""


def ensure_model_allowed(*, key: AuthenticatedKey, model: str) -> None:
    if not key.may_use_model(model):
        raise OpenAIError(
            403,
            f"This API key is not allowed to use the model '{model}'.",
            param="model",
            code="model_not_allowed",
        )


def prefix_cache_namespace(
    *, key: AuthenticatedKey, isolation: PrefixCacheIsolation, salt: str | None = None
) -> str | None:
    """The RPC ``cache_namespace`` (``TERN_PREFIX_CACHE_ISOLATION``), which is also the
    ``cache_salt`` sent to OpenAI-kind engines and the seed of the gateway's prefix routing.

    ``tenant`` (the default) sends the tenant id, so cached blocks only ever serve the tenant whose
    prompt made them. Sharing would be an oracle: a tenant's ``cached_tokens`` would tell it whether
    any other tenant had sent a prompt, such as a guessed system prompt. ``shared`` sends none, so
    every tenant's requests reuse each other's prefixes (one organisation's choice). A client's own
    ``cache_salt`` only narrows its namespace further: under ``tenant`` it is appended to the tenant
    id, never used in its place, so no salt reaches another tenant's cache.
    """
    if isolation == "tenant" and key.tenant_id is not None:
        return f"{key.tenant_id}:{salt}" if salt is not None else str(key.tenant_id)
    return salt


def list_models(*, pool: EnginePool, key: AuthenticatedKey) -> ModelList:
    """Models served by healthy engines that this key may use."""
    return ModelList(data=[m for m in pool.models() if key.may_use_model(m.id)])


async def dispatch(
    *,
    pool: EnginePool,
    openai_request: OpenAIRequest,
    raw_body: bytes,
    endpoint: str,
    key: AuthenticatedKey,
    request_id: str,
    cache_namespace: str | None,
    hooks: Sequence[CompletionHook],
    admitted: Admitted,
    journal: UsageJournal | None = None,
    responses_request: ResponsesRequest | None = None,
) -> RelayResponse:
    """Start the generation on an engine and return the response that relays it, with the headers
    and within the ``max_tokens`` cap the limits ``admitted`` it with.

    The caller has checked the key's model scope (:func:`ensure_model_allowed`). Refusals
    (no engine, engine errors before the stream) raise OpenAIError after the hooks ran. The
    engines serving the model decide the relay: Tern's RPC, or the client's own request
    (``raw_body``, already validated) forwarded to an OpenAI-compatible server. With
    ``responses_request`` (``/v1/responses``, ``openai_request`` its chat form) the answer is written
    in the Responses shape, whichever the engines' kind.
    """
    tenant_id = str(key.tenant_id) if key.tenant_id else None
    all_hooks = [observe_upstream_metrics, *hooks]
    relay: BaseRelay
    max_tokens_cap = admitted.max_tokens
    common: dict[str, Any] = {
        "pool": pool,
        "openai_request": openai_request,
        "endpoint": endpoint,
        "tenant_id": tenant_id,
        "key_id": str(key.key_id),
        "hooks": all_hooks,
        "journal": journal,
    }
    if pool.kind_for(openai_request.model) == "openai":
        if responses_request is not None:  # the chat request it amounts to, as JSON
            raw_body = openai_request.model_dump_json(exclude_defaults=True, by_alias=True).encode()
        body = capped_body(raw_body, openai_request=openai_request, max_tokens_cap=max_tokens_cap)
        upstream = common | {
            "body": salted_body(body, cache_namespace=cache_namespace, send_salt=pool.sends_cache_salt),
            "request_id": request_id,
            "token_counter": pool.token_counter,
            "cache_namespace": cache_namespace,
        }
        relay = (
            OpenAIRelay(**upstream)
            if responses_request is None
            else ResponsesOpenAIRelay(responses_request=responses_request, **upstream)
        )
    else:
        gen_request = openai_request.to_generate_request(
            request_id=request_id, cache_namespace=cache_namespace
        )
        if max_tokens_cap is not None:  # a request without max_tokens must not run to the context length
            sampling = gen_request.sampling
            sampling.max_tokens = min(sampling.max_tokens or max_tokens_cap, max_tokens_cap)
        gen_request.max_prompt_tokens = admitted.prompt_tokens  # the engine checks the prompt against it
        rpc = common | {"gen_request": gen_request, "top_up": admitted.top_up}
        relay = (
            Relay(**rpc)
            if responses_request is None
            else ResponsesRelay(responses_request=responses_request, **rpc)
        )
        await relay.open()
        return RelayResponse(relay, headers=relay.limit_headers or admitted.headers)
    await relay.open()
    return RelayResponse(relay, headers=admitted.headers)


def prompt_size(pool: EnginePool, request: OpenAIRequest) -> PromptSize:
    """What admission reserves the prompt from: for Tern engines an estimate plus the template's
    tokens (the engine checks it against the exact count before any work); for engines that check
    nothing (``openai``-kind upstreams), a true upper bound (worked out only if a limit counts tokens)."""
    overhead = pool.prompt_overhead(request.model)
    if overhead is not None and pool.kind_for(request.model) == "tern":
        return PromptSize(overhead=overhead)
    # An openai engine, or a Tern engine from before max_prompt_tokens (a rolling upgrade): no
    # engine checks the reservation, so it must hold any prompt.
    return PromptSize(overhead=UNMEASURED_OVERHEAD if overhead is None else overhead, bounded=True)


def salted_body(body: dict[str, Any], *, cache_namespace: str | None, send_salt: bool) -> dict[str, Any]:
    """The body for an OpenAI-kind engine, its ``cache_salt`` the request's cache namespace (vLLM keeps
    the prefixes of different salts apart). The client's own salt is already part of the namespace.
    Without ``send_salt`` (an upstream that rejects the field) none is sent."""
    body.pop("cache_salt", None)
    if send_salt and cache_namespace is not None:
        body["cache_salt"] = cache_namespace
    return body


def capped_body(
    raw_body: bytes, *, openai_request: OpenAIRequest, max_tokens_cap: int | None
) -> dict[str, Any]:
    """The client's request as JSON, its output length capped as the limits admitted it."""
    body: dict[str, Any] = orjson.loads(raw_body)
    if max_tokens_cap is not None:
        requested = openai_request.requested_max_tokens
        body[openai_request.max_tokens_field] = min(requested or max_tokens_cap, max_tokens_cap)
    return body


async def observe_upstream_metrics(outcome: RelayOutcome) -> None:
    if outcome.engine_url is None:
        return
    result = "client_closed" if outcome.client_disconnected else ("ok" if outcome.status < 400 else "error")
    upstream_latency_by(outcome.engine_url, "generate", result).observe(outcome.duration_s)
    if outcome.ttft_s is not None:
        upstream_ttft_by(outcome.engine_url).observe(outcome.ttft_s)


async def admit_and_dispatch(
    admitter: Admitter | None,
    *,
    key: AuthenticatedKey,
    openai_request: OpenAIRequest,
    request_id: str,
    dispatch: Callable[[Admitted], Awaitable[T]],
    pool: EnginePool,
) -> T:
    """Admit under the limits, then ``dispatch(admitted)`` (its headers, its max_tokens cap, its
    prompt reservation).

    A dispatch that fails releases the admission. Without an admitter (limits not wired) this is
    just ``dispatch`` with no headers and no cap.
    """
    if admitter is None:
        return await dispatch(Admitted(headers={}))
    prompt = prompt_size(pool, openai_request)
    admitted = await admitter.admit(key=key, request=openai_request, request_id=request_id, prompt=prompt)
    try:
        return await dispatch(admitted)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await admitter.release(request_id=request_id, key_id=str(key.key_id))
        raise
