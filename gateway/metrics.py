"""Prometheus metrics, on one registry that ``/metrics`` serves.

Other modules add their own metrics to ``REGISTRY`` (or use the shared ones below).
Routes are labelled by their template (``/admin/keys/{key_id}``), never the raw path.

With several worker processes (``tern gateway --workers N``) each worker counts in its own memory,
and a scrape would see only the worker that answered it. prometheus-client's multiprocess mode
fixes that: with ``PROMETHEUS_MULTIPROC_DIR`` set before the workers start, every worker writes its
values to files there and ``/metrics`` sums them. Counters and histograms are summed as they are;
each gauge names how workers' values combine (``multiprocess_mode``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector

MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

M = TypeVar("M", bound=MetricWrapperBase)

REGISTRY = CollectorRegistry(auto_describe=True)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

REQUESTS = Counter(
    "tern_http_requests_total",
    "HTTP requests handled by the gateway.",
    ["method", "route", "status"],
    registry=REGISTRY,
)
REQUEST_LATENCY = Histogram(
    "tern_http_request_duration_seconds",
    "Time from request start to the end of the response body.",
    ["method", "route"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
UPSTREAM_LATENCY = Histogram(
    "tern_upstream_request_duration_seconds",
    "Time spent on an engine RPC call (to the final frame for streams).",
    ["upstream", "rpc", "outcome"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
UPSTREAM_TIME_TO_FIRST_TOKEN = Histogram(
    "tern_upstream_time_to_first_token_seconds",
    "Time from sending a generate RPC to its first delta frame.",
    ["upstream"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
TOKENS = Counter(
    "tern_tokens_total",
    "Tokens metered, by tenant, model and kind (prompt, cached: the prompt tokens served from the "
    "prefix cache, completion); what the usage rows say, counted as the requests finish.",
    ["tenant", "model", "kind"],
    registry=REGISTRY,
)
LIMIT_REFUSALS = Counter(
    "tern_limit_refusals_total",
    "Requests refused by the limits before any engine work, by the limit that refused them "
    "(rpm, tpm, tpm_too_large, concurrency, token_budget, spend_budget, limiter_unavailable).",
    ["limit"],
    registry=REGISTRY,
)
USAGE_QUEUE = Gauge(
    "tern_usage_queue_records",
    "Usage records waiting in this process's buffer for the next write to Postgres.",
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
JOURNAL_SYNCS = Counter(
    "tern_usage_journal_syncs_total",
    "Group commits (fsyncs) of the usage journal; records / syncs is how many requests each served.",
    registry=REGISTRY,
)
JOURNAL_SYNCED_RECORDS = Counter(
    "tern_usage_journal_synced_lines_total",
    "Journal lines made durable by the group commits.",
    registry=REGISTRY,
)
USAGE_FLUSH_ERRORS = Counter(
    "tern_usage_flush_errors_total",
    "Usage batches Postgres did not take (kept in the journal, written again later).",
    registry=REGISTRY,
)
USAGE_QUARANTINED = Counter(
    "tern_usage_quarantined_lines_total",
    "Usage journal lines Postgres rejected for their content (or that did not read), moved to rejected/.",
    registry=REGISTRY,
)
USAGE_LEDGER_ABANDONED = Counter(
    "tern_usage_ledger_recoveries_abandoned_total",
    "Dead gateway processes whose cut streams on an engine were not billed from its ledger, by why.",
    ["reason"],
    registry=REGISTRY,
)
ENGINE_HEALTHY = Gauge(
    "tern_engine_healthy",
    "1 while an engine is in the rotation, 0 while it is out (as the last health probe found).",
    ["engine"],
    registry=REGISTRY,
    multiprocess_mode="livemin",
)

BUDGET_USED_RATIO = Gauge(
    "tern_budget_used_ratio",
    "A budget's settled usage over its limit in the current period, by scope "
    "(key:<id>:tokens:day, tenant:<id>:spend:month, ...), as of the last request it settled.",
    ["scope"],
    registry=REGISTRY,
    multiprocess_mode="livemax",
)


class Children(Generic[M]):
    """A labelled metric's children, each looked up once: ``labels()`` validates and locks on every
    call, which adds up on the request path. Only for label sets that are bounded (route templates,
    statuses, engine URLs)."""

    def __init__(self, metric: M) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *labels: str) -> M:
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = self.metric.labels(*labels)
        return child


requests_by = Children(REQUESTS)
request_latency_by = Children(REQUEST_LATENCY)
upstream_latency_by = Children(UPSTREAM_LATENCY)
upstream_ttft_by = Children(UPSTREAM_TIME_TO_FIRST_TOKEN)
limit_refusals_by = Children(LIMIT_REFUSALS)
engine_healthy_by = Children(ENGINE_HEALTHY)
budget_used_ratio_by = Children(BUDGET_USED_RATIO)


def exposition() -> bytes:
    """The text ``/metrics`` serves: this process's registry, or every worker's values summed."""
    if MULTIPROCESS_DIR_ENV not in os.environ:
        return generate_latest(REGISTRY)
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return generate_latest(registry)


def prepare_multiprocess_dir() -> Path | None:
    """Before starting worker processes: an empty directory for their metric files, named in the
    environment the workers inherit. Returns the directory when it was created here (the caller
    removes it), None when the operator named one (its old files are removed, as
    prometheus-client asks, so a restart does not add up the previous run's counts)."""
    named = os.environ.get(MULTIPROCESS_DIR_ENV)
    if named:
        directory = Path(named)
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("*.db"):
            stale.unlink()
        return None
    directory = Path(tempfile.mkdtemp(prefix="tern-metrics-"))
    os.environ[MULTIPROCESS_DIR_ENV] = str(directory)
    return directory
