"""The engines behind the gateway: one pooled aiohttp session per upstream, health probing, picking.

Each engine has a kind (``gateway.config.EngineSpec``): ``tern`` speaks protocol/rpc.py, ``openai``
is any server with ``/v1/models`` and ``/v1/(chat/)completions`` (vLLM, SGLang, llama.cpp, Tern's
own ``/v1``). An ``openai`` engine is probed on ``/health`` where it has one (a 404 means it has
none) and on ``/v1/models``, which also names its models; ``TERN_ENGINE_MODEL_MAP`` renames them
to the names clients use.

aiohttp rather than httpx for this hop: at 64 concurrent requests httpx's pool
caps throughput more than ten times lower (docs/benchmarks/gateway-upstream-client.md).

An engine is in the rotation only while its last health probe answered
``{"status": "ok"}``; a failed probe or a refused connection takes it out at
once, and the background prober puts it back when it answers again. The models
an engine serves are refreshed with every successful probe.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from gateway.config import EngineKind, EngineSpec, RoutingPolicy, parse_engine_url
from gateway.metrics import engine_healthy_by
from gateway.proxy.engine_discovery import EngineDiscovery, Resolver, resolve_host
from gateway.proxy.prefix_routing import PrefixTable, PromptKeys, RoutingParams
from gateway.proxy.token_count import TokenCounter
from protocol.rpc import HEALTH_PATH, MODELS_PATH, HealthResponse, ModelInfo, ModelList

log = logging.getLogger(__name__)

READ_BUFFER_BYTES = 1 << 20
"""Largest NDJSON frame line the relay accepts (frames with logprobs can be long)."""

OPENAI_HEALTH_PATH = "/health"
OPENAI_MODELS_PATH = "/v1/models"
OPENAI_CHAT_PATH = "/v1/chat/completions"
OVERHEAD_PROBE_TIMEOUT_S = 30.0
"""A one-token generation, once per model of an ``openai`` engine: it may queue behind others."""


class NoHealthyEngine(Exception):
    """No engine is in the rotation."""


class ModelNotServed(Exception):
    """Engines are up, but none of them serves the requested model."""


@dataclass(eq=False)
class Upstream:
    """One engine: its URL, its pooled session and what the prober last learned."""

    url: str
    session: aiohttp.ClientSession
    kind: EngineKind = "tern"
    healthy: bool = False
    models: tuple[ModelInfo, ...] = ()
    model_ids: frozenset[str] = frozenset()
    inflight: int = 0
    last_error: str | None = field(default=None, repr=False)

    def serves(self, model: str) -> bool:
        return model in self.model_ids


class ModelNames:
    """Served model names <-> the names ``openai`` engines know them by (``TERN_ENGINE_MODEL_MAP``)."""

    def __init__(self, served_to_upstream: Mapping[str, str] | None = None) -> None:
        self._to_upstream = dict(served_to_upstream or {})
        self._to_served = {upstream: served for served, upstream in self._to_upstream.items()}

    def upstream(self, served: str) -> str:
        return self._to_upstream.get(served, served)

    def served(self, upstream: str) -> str:
        return self._to_served.get(upstream, upstream)


class EnginePool:
    """Picks the least-busy healthy engine for a model."""

    def __init__(
        self,
        engines: Sequence[str | EngineSpec],
        *,
        health_interval_s: float = 2.0,
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 600.0,
        max_connections_per_engine: int = 1024,
        api_key: str | None = None,
        model_names: ModelNames | None = None,
        token_counter: TokenCounter | None = None,
        routing: RoutingPolicy = "cache_aware",
        routing_params: RoutingParams | None = None,
        sends_cache_salt: bool = True,
        resolver: Resolver = resolve_host,
    ) -> None:
        self._specs = [parse_engine_url(e) if isinstance(e, str) else e for e in engines]
        self.discovery = EngineDiscovery(self._specs, resolver)
        self._openai_headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        self.model_names = model_names or ModelNames()
        self.token_counter = token_counter or TokenCounter()
        self.routing = routing
        self.sends_cache_salt = sends_cache_salt
        """OpenAI-kind engines get the request's cache namespace as vLLM's ``cache_salt``."""
        self.prefixes = PrefixTable(routing_params)
        self._has_openai = any(spec.kind == "openai" for spec in self._specs)
        self._health_interval_s = health_interval_s
        self._probe_timeout = aiohttp.ClientTimeout(total=min(health_interval_s, connect_timeout_s))
        self._request_timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_read=request_timeout_s
        )
        self._max_connections = max_connections_per_engine
        self.upstreams: list[Upstream] = []
        self._retired: list[Upstream] = []
        """Engines discovery dropped, kept open until their last request ends."""
        self._turn = itertools.count()
        self._prober: asyncio.Task[None] | None = None
        self._overheads: dict[str, int] = {}
        """Per served model: the most tokens its chat template adds around one empty user message, as
        its healthy engines report it (or as measured, for ``openai`` ones); absent when one of them
        does not say (a Tern engine from before ``max_prompt_tokens``)."""
        self._measured: dict[str, int] = {}
        """``openai`` engines' overheads measured so far, by served model name: once per model."""

    async def start(self) -> None:
        """Open the sessions, probe every engine once, then keep probing in the background."""
        self.upstreams = [self._open(spec) for spec in await self.discovery.engines()]
        await self.probe_all()
        self._prober = asyncio.create_task(self._probe_forever(), name="engine-health-prober")

    def _open(self, spec: EngineSpec) -> Upstream:
        self._has_openai = self._has_openai or spec.kind == "openai"
        return Upstream(
            url=spec.url,
            kind=spec.kind,
            session=aiohttp.ClientSession(
                base_url=spec.url,
                connector=aiohttp.TCPConnector(limit=self._max_connections),
                timeout=self._request_timeout,
                read_bufsize=READ_BUFFER_BYTES,
                headers=self._openai_headers if spec.kind == "openai" else None,
            ),
        )

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            await asyncio.gather(self._prober, return_exceptions=True)
            self._prober = None
        sessions = [u.session.close() for u in self.upstreams + self._retired]
        await asyncio.gather(*sessions, return_exceptions=True)

    async def rediscover(self) -> None:
        """Follow the ``dns+`` entries: open engines that appeared, retire those that went away (new
        requests skip them at once; their session closes when their last request ends)."""
        if self.discovery.dynamic:
            specs = {spec.url: spec for spec in await self.discovery.engines()}
            known = {u.url for u in self.upstreams}
            for upstream in [u for u in self.upstreams if u.url not in specs]:
                log.info("engine %s is gone from discovery", upstream.url)
                self.mark_unhealthy(upstream, "gone from discovery")
                self.upstreams.remove(upstream)
                self._retired.append(upstream)
            added = [self._open(spec) for url, spec in specs.items() if url not in known]
            self.upstreams.extend(added)
            await asyncio.gather(*(self._probe(u) for u in added))
        done = [u for u in self._retired if u.inflight == 0]
        self._retired = [u for u in self._retired if u.inflight > 0]
        await asyncio.gather(*(u.session.close() for u in done), return_exceptions=True)

    # -- health

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(u) for u in self.upstreams))

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval_s)
            try:
                await self.rediscover()
            except Exception:  # discovery must never stop the health probes
                log.exception("engine discovery failed")
            await self.probe_all()

    async def _probe(self, upstream: Upstream) -> None:
        try:
            if upstream.kind == "openai":
                models = await self._probe_openai(upstream)
            else:
                models = await self._probe_tern(upstream)
        except Exception as exc:
            self.mark_unhealthy(upstream, f"{type(exc).__name__}: {exc}")
            return
        if not upstream.healthy:
            log.info("engine %s is healthy (models: %s)", upstream.url, [m.id for m in models])
        upstream.models = tuple(models)
        upstream.model_ids = frozenset(m.id for m in models)
        upstream.healthy = True
        upstream.last_error = None
        engine_healthy_by(upstream.url).set(1)
        self._refresh_overheads()

    def _refresh_overheads(self) -> None:
        """Worked out when the engines change, not per request (``prompt_overhead``)."""
        reported: dict[str, int] = {}
        unsaid: set[str] = set()
        for upstream in self.upstreams:
            for m in upstream.models if upstream.healthy else ():
                if m.prompt_overhead is None:
                    unsaid.add(m.id)
                else:
                    reported[m.id] = max(reported.get(m.id, 0), m.prompt_overhead)
        self._overheads = {model: n for model, n in reported.items() if model not in unsaid}

    async def _probe_tern(self, upstream: Upstream) -> list[ModelInfo]:
        async with upstream.session.get(HEALTH_PATH, timeout=self._probe_timeout) as resp:
            if resp.status != 200:
                raise RuntimeError(f"health answered HTTP {resp.status}")
            health = HealthResponse.model_validate_json(await resp.read())
        if health.status != "ok":
            raise RuntimeError(f"engine is {health.status}")
        async with upstream.session.get(MODELS_PATH, timeout=self._probe_timeout) as resp:
            resp.raise_for_status()
            return ModelList.model_validate_json(await resp.read()).data

    async def _probe_openai(self, upstream: Upstream) -> list[ModelInfo]:
        """``/health`` where the server has one (404: it has none), then ``/v1/models``, renamed."""
        async with upstream.session.get(OPENAI_HEALTH_PATH, timeout=self._probe_timeout) as resp:
            await resp.read()
            if resp.status not in (200, 404):
                raise RuntimeError(f"health answered HTTP {resp.status}")
        async with upstream.session.get(OPENAI_MODELS_PATH, timeout=self._probe_timeout) as resp:
            if resp.status != 200:
                raise RuntimeError(f"/v1/models answered HTTP {resp.status}")
            listed = ModelList.model_validate_json(await resp.read()).data
        names = self.model_names
        served = []
        for m in listed:
            name = names.served(m.id)
            overhead = m.prompt_overhead if m.prompt_overhead is not None else self._measured.get(name)
            if overhead is None and (overhead := await self._measure_overhead(upstream, m.id)) is not None:
                self._measured[name] = overhead
            served.append(m.model_copy(update={"id": name, "prompt_overhead": overhead}))
        return served

    async def _measure_overhead(self, upstream: Upstream, model: str) -> int | None:
        """The prompt tokens an ``openai`` engine reports for one empty user message: its chat
        template's own tokens, for the prompt bound (``token_count.prompt_upper_bound``). Once per
        model; None (tried again at the next probe) when the engine does not say."""
        body = {"model": model, "messages": [{"role": "user", "content": ""}], "max_tokens": 1}
        timeout = aiohttp.ClientTimeout(total=OVERHEAD_PROBE_TIMEOUT_S)
        try:
            async with upstream.session.post(OPENAI_CHAT_PATH, json=body, timeout=timeout) as resp:
                usage = (await resp.json()).get("usage") if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("cannot measure the chat template of %s on %s: %s", model, upstream.url, exc)
            return None
        count = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        return count if isinstance(count, int) else None

    def mark_unhealthy(self, upstream: Upstream, reason: str) -> None:
        """Take an engine out of the rotation until a probe succeeds again."""
        if upstream.healthy:
            log.warning("engine %s left the rotation: %s", upstream.url, reason)
        upstream.healthy = False
        upstream.last_error = reason
        self._refresh_overheads()
        self.prefixes.forget(upstream)
        engine_healthy_by(upstream.url).set(0)

    async def any_healthy(self) -> bool:
        """For ``/readyz``: is at least one engine in the rotation (as of the last probe)?"""
        return any(u.healthy for u in self.upstreams)

    # -- routing

    def models(self) -> list[ModelInfo]:
        """The models served by healthy engines, one entry per id."""
        seen: dict[str, ModelInfo] = {}
        for upstream in self.upstreams:
            if upstream.healthy:
                for model in upstream.models:
                    seen.setdefault(model.id, model)
        return list(seen.values())

    def prompt_overhead(self, model: str) -> int | None:
        """Tokens ``model``'s chat template adds around one empty user message; None: unknown, or
        some engine serving it does not say (and, if a Tern engine, checks no reservation)."""
        return self._overheads.get(model)

    def kind_for(self, model: str) -> EngineKind:
        """How to talk to the engines serving ``model``: ``openai`` if a healthy one of that kind
        serves it, else ``tern`` (whose relay also answers "no engine" and "no such model")."""
        if self._has_openai:
            for upstream in self.upstreams:
                if upstream.kind == "openai" and upstream.healthy and upstream.serves(model):
                    return "openai"
        return "tern"

    def pick(
        self,
        model: str,
        *,
        exclude: Sequence[Upstream] = (),
        kind: EngineKind | None = None,
        prompt: PromptKeys | None = None,
    ) -> Upstream:
        """The healthy engine serving ``model`` that the routing policy picks.

        ``cache_aware`` (the default): the engine likely to hold ``prompt``'s prefix, within the load
        slack (gateway/proxy/prefix_routing.py). ``least_loaded``: the fewest requests in flight,
        ties rotating. ``round_robin``: each in turn. ``kind``: only engines of that kind (a relay
        speaks one protocol, its retries too)."""
        healthy = [u for u in self.upstreams if u.healthy and u not in exclude]
        if not healthy:
            raise NoHealthyEngine
        candidates = [u for u in healthy if u.serves(model) and (kind is None or u.kind == kind)]
        if not candidates:
            raise ModelNotServed(model)
        if len(candidates) == 1:
            return candidates[0]
        if self.routing == "cache_aware":
            keys = prompt.keys if prompt is not None else []
            chosen = self.prefixes.choose(keys, candidates, [u.inflight for u in candidates])
            if keys:
                self.prefixes.insert(keys, chosen)
            return chosen
        start = next(self._turn) % len(candidates)
        if self.routing == "round_robin":
            return candidates[start]
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=lambda u: u.inflight)
