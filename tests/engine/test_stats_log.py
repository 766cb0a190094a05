"""The engine's periodic summary line (like vLLM's): rates over the interval, queues, cache use."""

import logging

import pytest

from engine.metrics import EngineMetrics, StatsLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_summary_line_every_interval_with_rates_over_that_interval(caplog: pytest.LogCaptureFixture) -> None:
    metrics, clock = EngineMetrics(), Clock()
    metrics.prompt_tokens.inc(1000)  # before the interval: not counted
    stats = StatsLog(metrics, interval_s=10.0, clock=clock)
    metrics.prompt_tokens.inc(400)
    metrics.cached_prompt_tokens.inc(100)
    metrics.generation_tokens.inc(250)
    metrics.set_queues(running=3, waiting=2, blocks_used=25, blocks_free=75)
    clock.now += 9.9
    assert stats.maybe_log() is None
    clock.now += 0.1
    with caplog.at_level(logging.INFO, logger="engine.stats"):
        line = stats.maybe_log()
    assert line == (
        "running: 3 reqs, waiting: 2 reqs, prompt: 40.0 tok/s, generation: 25.0 tok/s, "
        "KV cache: 25.0% used, prefix cache hit rate: 25.0%"
    )
    assert line in caplog.text
    clock.now += 5  # a new interval starts at each line
    assert stats.maybe_log() is None


def test_idle_time_does_not_dilute_the_rates() -> None:
    metrics, clock = EngineMetrics(), Clock()
    stats = StatsLog(metrics, interval_s=10.0, clock=clock)
    clock.now += 600  # idle
    stats.restart()
    metrics.generation_tokens.inc(100)
    clock.now += 10
    line = stats.maybe_log()
    assert line is not None and "generation: 10.0 tok/s" in line and "prefix cache hit rate: 0.0%" in line
