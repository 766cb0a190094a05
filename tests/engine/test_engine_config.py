"""EngineConfig's resolved defaults: the torch thread count."""

from __future__ import annotations

import logging
import os

import pytest

from engine import config as config_module
from engine.cli import ProbeAccessFilter
from engine.config import EngineConfig, available_physical_cores, default_num_threads


def test_explicit_threads_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert EngineConfig(num_threads=5).resolved_num_threads() == 5
    assert EngineConfig().resolved_num_threads() == 3


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (4, 3), (16, 15)])
def test_default_leaves_a_core_for_the_server(
    monkeypatch: pytest.MonkeyPatch, cores: int, threads: int
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(config_module, "available_physical_cores", lambda: cores)
    assert default_num_threads() == threads
    assert EngineConfig().resolved_num_threads() == threads


def test_available_physical_cores_is_within_the_cpus_we_may_use() -> None:
    assert 1 <= available_physical_cores() <= len(os.sched_getaffinity(0))


def test_probe_requests_are_left_out_of_the_access_log() -> None:
    """uvicorn's access record args are (client, method, path, HTTP version, status)."""

    def record(path: str) -> logging.LogRecord:
        args = ("127.0.0.1:5000", "GET", path, "1.1", 200)
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d', args, None)

    keep = ProbeAccessFilter().filter
    assert not keep(record("/health"))
    assert not keep(record("/rpc/v1/health"))
    assert not keep(record("/rpc/v1/models"))  # the gateway reads it after every health probe
    assert not keep(record("/metrics?x=1"))
    assert keep(record("/v1/chat/completions"))
    assert keep(record("/rpc/v1/generate"))
    assert keep(logging.LogRecord("uvicorn.access", logging.INFO, "", 0, "no args", None, None))
