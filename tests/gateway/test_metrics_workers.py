"""``/metrics`` of a gateway with several worker processes counts every worker's requests.

Each request goes over a new connection, so the kernel spreads them over both workers; every
scrape, whichever worker answers it, must show all of them.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx

REQUESTS = 40


def healthz_count(exposition: str) -> float:
    match = re.search(
        r'^tern_http_requests_total\{method="GET",route="/healthz",status="200"\} (\S+)$', exposition, re.M
    )
    return float(match.group(1)) if match else 0.0


def scrape(gateway: str) -> float:
    with httpx.Client(timeout=10) as fresh_connection:
        return healthz_count(fresh_connection.get(f"{gateway}/metrics").text)


def test_metrics_sum_over_worker_processes(gateway_processes: Callable[..., list[str]]) -> None:
    [gateway] = gateway_processes(1, workers=2)
    before = scrape(gateway)  # the start-up health checks
    for _ in range(REQUESTS):
        with httpx.Client(timeout=10) as fresh_connection:
            assert fresh_connection.get(f"{gateway}/healthz").status_code == 200
    assert [scrape(gateway) for _ in range(8)] == [before + REQUESTS] * 8
