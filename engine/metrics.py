"""Prometheus metrics of one engine, on its own registry (so tests can run several engines), under
Tern's names and, for Kubernetes' inference routers, vLLM's (:class:`VllmMetrics`).

Token rates are counters: Prometheus derives per-second rates with ``rate()``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.cache.radix_cache import CacheStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30, 60)


_GRAMMAR_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("tern_engine_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("tern_engine_requests_waiting", "Sequences waiting to be scheduled", registry=r)
        self.kv_blocks_used = Gauge("tern_engine_kv_blocks_used", "KV-cache blocks in use", registry=r)
        self.kv_blocks_free = Gauge("tern_engine_kv_blocks_free", "Free KV-cache blocks", registry=r)
        self.prompt_tokens = Counter("tern_engine_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_prompt_tokens = Counter(
            "tern_engine_prompt_tokens_cached", "Prompt tokens served from the prefix cache", registry=r
        )
        self.generation_tokens = Counter("tern_engine_generation_tokens", "Tokens generated", registry=r)
        self.preemptions = Counter("tern_engine_preemptions", "Sequences preempted for recompute", registry=r)
        self.requests_finished = Counter(
            "tern_engine_requests_finished", "Finished requests", ["finish_reason"], registry=r
        )
        self.time_to_first_token = Histogram(
            "tern_engine_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "tern_engine_inter_token_latency_seconds",
            "Time between consecutive tokens of a sequence",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefix_cache_blocks = Gauge(
            "tern_engine_prefix_cache_blocks", "KV blocks held by the prefix cache", registry=r
        )
        self.prefix_cache_tokens = Gauge(
            "tern_engine_prefix_cache_tokens", "Tokens held by the prefix cache", registry=r
        )
        self.prefix_cache_evicted_blocks = Counter(
            "tern_engine_prefix_cache_evicted_blocks", "KV blocks evicted from the prefix cache", registry=r
        )
        self._evicted_seen = 0
        self.draft_tokens = Counter(
            "tern_engine_spec_draft_tokens", "Speculative draft tokens proposed and checked", registry=r
        )
        self.accepted_draft_tokens = Counter(
            "tern_engine_spec_accepted_tokens", "Speculative draft tokens the model agreed with", registry=r
        )
        self.draft_acceptance = Histogram(
            "tern_engine_spec_acceptance_rate",
            "Share of a step's drafts a sequence kept (one observation per sequence and step with drafts)",
            buckets=(0.0, 0.2, 0.4, 0.6, 0.8, 1.0),
            registry=r,
        )
        self.grammar_compile_seconds = Histogram(
            "tern_engine_grammar_compile_seconds",
            "Compiling a structured-output grammar (cache misses only)",
            buckets=_GRAMMAR_BUCKETS,
            registry=r,
        )
        self.grammar_cache_hits = Counter(
            "tern_engine_grammar_cache_hits", "Structured-output grammars found compiled already", registry=r
        )
        self.grammar_wait_seconds = Histogram(
            "tern_engine_grammar_wait_seconds",
            "Time a constrained request waited for its grammar before it could be queued",
            buckets=_GRAMMAR_BUCKETS,
            registry=r,
        )

        self.vllm: VllmMetrics | None = None

    def add_vllm_names(self, *, model_name: str, block_size: int, num_blocks: int) -> None:
        """Also publish vLLM's names for the queue and the cache (engine/vllm_metrics.py)."""
        self.vllm = VllmMetrics(
            self.registry, model_name=model_name, block_size=block_size, num_blocks=num_blocks
        )

    def set_queues(
        self, *, running: int, waiting: int, blocks_used: int, blocks_free: int, blocks_reclaimable: int = 0
    ) -> None:
        """``blocks_reclaimable``: cached blocks no request holds (used for Tern's gauge, free for vLLM's)."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_blocks_used.set(blocks_used)
        self.kv_blocks_free.set(blocks_free)
        if self.vllm is not None:
            self.vllm.update(running=running, waiting=waiting, blocks_in_use=blocks_used - blocks_reclaimable)

    def set_prefix_cache(self, stats: CacheStats) -> None:
        self.prefix_cache_blocks.set(stats.tree_blocks)
        self.prefix_cache_tokens.set(stats.tree_tokens)
        self.prefix_cache_evicted_blocks.inc(stats.evicted_blocks - self._evicted_seen)
        self._evicted_seen = stats.evicted_blocks

    def render(self) -> bytes:
        return generate_latest(self.registry)


_LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"
"""vLLM labels each engine core of a process; a Tern process has one."""


class VllmMetrics:
    """vLLM's metric names beside Tern's own (``--no-vllm-metrics`` turns them off), so a Gateway API
    Inference Extension endpoint picker (llm-d's router) schedules a Tern engine as it does a vLLM pod.

    The picker scrapes the serving port's ``/metrics`` (every 50 ms by default) and reads, for a pod
    labelled ``llm-d.ai/engine-type: vllm``: the queue (``vllm:num_requests_waiting``), the batch
    (``vllm:num_requests_running``), KV-cache use as a fraction (``vllm:kv_cache_usage_perc``), the
    cache's shape (``vllm:cache_config_info``: its labels ``block_size`` and ``num_gpu_blocks`` size the
    approximate prefix scorer) and LoRA state (``vllm:lora_requests_info``). All gauges, as vLLM's, with
    its labels and meanings; docs/operations.md says which llm-d files read them."""

    def __init__(
        self, registry: CollectorRegistry, *, model_name: str, block_size: int, num_blocks: int
    ) -> None:
        self.num_blocks = num_blocks
        labels = (model_name, ENGINE_INDEX)
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in the model's running batch", _LABELS, registry=registry
        ).labels(*labels)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled", _LABELS, registry=registry
        ).labels(*labels)
        self.kv_cache_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache use, 0 to 1: blocks held by requests (cached blocks no request holds count as free, "
            "as in vLLM)",
            _LABELS,
            registry=registry,
        ).labels(*labels)
        cache_config = Gauge(
            "vllm:cache_config_info",
            "Information of the KV cache's configuration (value 1)",
            ("block_size", "num_gpu_blocks", "enable_prefix_caching"),
            registry=registry,
        )
        cache_config.labels(str(block_size), str(num_blocks), "True").set(1)
        # Tern serves no LoRA adapters: max_lora 0 and none running or waiting, as vLLM reports it
        # without --enable-lora. The value is the time of the last update, which the picker uses to
        # take the newest series.
        self._lora = Gauge(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests (value: time of the last update)",
            ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
            registry=registry,
        ).labels("0", "", "")
        self._lora.set(time.time())

    def update(self, *, running: int, waiting: int, blocks_in_use: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_cache_usage.set(blocks_in_use / self.num_blocks if self.num_blocks else 0.0)
        self._lora.set(time.time())


log = logging.getLogger("engine.stats")


class StatsLog:
    """One summary line every ``interval_s`` while the engine is busy, as vLLM logs: queue sizes,
    prompt and generation throughput over the interval, KV-cache use and prefix-cache hit rate.
    Operators read it in the logs without a Prometheus server; an idle engine logs nothing."""

    COUNTERS = (
        "tern_engine_prompt_tokens_total",
        "tern_engine_prompt_tokens_cached_total",
        "tern_engine_generation_tokens_total",
    )

    def __init__(
        self, metrics: EngineMetrics, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.metrics = metrics
        self.interval_s = interval_s
        self.clock = clock
        self.restart()

    def _sample(self, name: str) -> float:
        return self.metrics.registry.get_sample_value(name) or 0.0

    def restart(self) -> None:
        """Start a new interval (after idling, so idle time does not dilute the rates)."""
        self._start = self.clock()
        self._counts = [self._sample(name) for name in self.COUNTERS]

    def maybe_log(self) -> str | None:
        """Log and return the summary when the interval is over; else None."""
        elapsed = self.clock() - self._start
        if elapsed < self.interval_s:
            return None
        now = [self._sample(name) for name in self.COUNTERS]
        prompt, cached, generated = (after - before for after, before in zip(now, self._counts, strict=True))
        used = self._sample("tern_engine_kv_blocks_used")
        total = used + self._sample("tern_engine_kv_blocks_free")
        line = (
            f"running: {self._sample('tern_engine_requests_running'):.0f} reqs, "
            f"waiting: {self._sample('tern_engine_requests_waiting'):.0f} reqs, "
            f"prompt: {prompt / elapsed:.1f} tok/s, generation: {generated / elapsed:.1f} tok/s, "
            f"KV cache: {100 * used / total if total else 0:.1f}% used, "
            f"prefix cache hit rate: {100 * cached / prompt if prompt else 0:.1f}%"
        )
        log.info(line)
        self.restart()
        return line
