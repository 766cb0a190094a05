"""The engines behind the gateway: one pooled aiohttp session per upstream, health probing, picking.

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
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from gateway.metrics import engine_healthy_by
from protocol.rpc import HEALTH_PATH, MODELS_PATH, HealthResponse, ModelInfo, ModelList

log = logging.getLogger(__name__)

READ_BUFFER_BYTES = 1 << 20
"""Largest NDJSON frame line the relay accepts (frames with logprobs can be long)."""


class NoHealthyEngine(Exception):
    """No engine is in the rotation."""


class ModelNotServed(Exception):
    """Engines are up, but none of them serves the requested model."""


@dataclass(eq=False)
class Upstream:
    """One engine: its URL, its pooled session and what the prober last learned."""

    url: str
    session: aiohttp.ClientSession
    healthy: bool = False
    models: tuple[ModelInfo, ...] = ()
    model_ids: frozenset[str] = frozenset()
    inflight: int = 0
    last_error: str | None = field(default=None, repr=False)

    def serves(self, model: str) -> bool:
        return model in self.model_ids


class EnginePool:
    """Picks the least-busy healthy engine for a model."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        health_interval_s: float = 2.0,
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 600.0,
        max_connections_per_engine: int = 1024,
    ) -> None:
        self._urls = [u.rstrip("/") for u in urls]
        self._health_interval_s = health_interval_s
        self._probe_timeout = aiohttp.ClientTimeout(total=min(health_interval_s, connect_timeout_s))
        self._request_timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_read=request_timeout_s
        )
        self._max_connections = max_connections_per_engine
        self.upstreams: list[Upstream] = []
        self._turn = itertools.count()
        self._prober: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Open the sessions, probe every engine once, then keep probing in the background."""
        self.upstreams = [
            Upstream(
                url=url,
                session=aiohttp.ClientSession(
                    base_url=url,
                    connector=aiohttp.TCPConnector(limit=self._max_connections),
                    timeout=self._request_timeout,
                    read_bufsize=READ_BUFFER_BYTES,
                ),
            )
            for url in self._urls
        ]
        await self.probe_all()
        self._prober = asyncio.create_task(self._probe_forever(), name="engine-health-prober")

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            await asyncio.gather(self._prober, return_exceptions=True)
            self._prober = None
        await asyncio.gather(*(u.session.close() for u in self.upstreams), return_exceptions=True)

    # -- health

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(u) for u in self.upstreams))

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval_s)
            await self.probe_all()

    async def _probe(self, upstream: Upstream) -> None:
        try:
            async with upstream.session.get(HEALTH_PATH, timeout=self._probe_timeout) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"health answered HTTP {resp.status}")
                health = HealthResponse.model_validate_json(await resp.read())
            if health.status != "ok":
                raise RuntimeError(f"engine is {health.status}")
            async with upstream.session.get(MODELS_PATH, timeout=self._probe_timeout) as resp:
                resp.raise_for_status()
                models = ModelList.model_validate_json(await resp.read()).data
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

    def mark_unhealthy(self, upstream: Upstream, reason: str) -> None:
        """Take an engine out of the rotation until a probe succeeds again."""
        if upstream.healthy:
            log.warning("engine %s left the rotation: %s", upstream.url, reason)
        upstream.healthy = False
        upstream.last_error = reason
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

    def pick(self, model: str, *, exclude: Sequence[Upstream] = ()) -> Upstream:
        """The healthy engine serving ``model`` with the fewest requests in flight (ties rotate)."""
        healthy = [u for u in self.upstreams if u.healthy and u not in exclude]
        if not healthy:
            raise NoHealthyEngine
        candidates = [u for u in healthy if u.serves(model)]
        if not candidates:
            raise ModelNotServed(model)
        if len(candidates) == 1:
            return candidates[0]
        start = next(self._turn) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=lambda u: u.inflight)
