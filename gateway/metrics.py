"""Prometheus metrics, on one registry that ``/metrics`` serves.

Other modules add their own metrics to ``REGISTRY`` (or use the shared ones below).
Routes are labelled by their template (``/admin/keys/{key_id}``), never the raw path.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

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
