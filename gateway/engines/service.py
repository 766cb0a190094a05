"""What each engine is doing: the pool's health view joined with the engine's Prometheus metrics."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.engines.schemas import EngineOut
from gateway.proxy.engine_pool import EnginePool, Upstream

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
METRICS_TIMEOUT_S = 2.0

# Engine metric samples (engine/metrics.py) -> the names used here; counters carry ``_total``.
SAMPLES = {
    "tern_engine_requests_running": "running",
    "tern_engine_requests_waiting": "waiting",
    "tern_engine_kv_blocks_used": "kv_blocks_used",
    "tern_engine_kv_blocks_free": "kv_blocks_free",
    "tern_engine_prompt_tokens_total": "prompt_tokens",
    "tern_engine_prompt_tokens_cached_total": "cached_prompt_tokens",
}


def parse_engine_metrics(text: str) -> dict[str, float]:
    """The samples of ``SAMPLES`` found in a Prometheus exposition, summed over their labels."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = SAMPLES.get(sample.name)
            if name is not None:
                values[name] = values.get(name, 0.0) + sample.value
    return values


def _ratio(part: float | None, whole: float | None) -> float | None:
    if part is None or not whole:
        return None
    return part / whole


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def describe(upstream: Upstream, metrics: dict[str, float]) -> EngineOut:
    used, free = metrics.get("kv_blocks_used"), metrics.get("kv_blocks_free")
    total = used + free if used is not None and free is not None else None
    prompt, cached = metrics.get("prompt_tokens"), metrics.get("cached_prompt_tokens")
    return EngineOut(
        url=upstream.url,
        kind=upstream.kind,
        healthy=upstream.healthy,
        error=upstream.last_error,
        models=[m.id for m in upstream.models] if upstream.healthy else [],
        inflight=upstream.inflight,
        running=_int(metrics.get("running")),
        waiting=_int(metrics.get("waiting")),
        kv_blocks_used=_int(used),
        kv_blocks_total=_int(total),
        kv_cache_usage=_ratio(used, total),
        prompt_tokens=_int(prompt),
        cached_prompt_tokens=_int(cached),
        prefix_cache_hit_rate=_ratio(cached, prompt),
    )


async def _read_metrics(upstream: Upstream) -> dict[str, float]:
    """The engine's metrics; empty when it is out of the rotation or does not answer in time."""
    if not upstream.healthy:
        return {}
    try:
        timeout = aiohttp.ClientTimeout(total=METRICS_TIMEOUT_S)
        async with upstream.session.get(METRICS_PATH, timeout=timeout) as resp:
            resp.raise_for_status()
            return parse_engine_metrics(await resp.text())
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        log.warning("engine metrics unavailable", extra={"engine": upstream.url, "error": repr(exc)})
        return {}


async def list_engines(*, pool: EnginePool) -> list[EngineOut]:
    metrics = await asyncio.gather(*(_read_metrics(u) for u in pool.upstreams))
    return [describe(u, m) for u, m in zip(pool.upstreams, metrics, strict=True)]
