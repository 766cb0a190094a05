"""EngineConfig's resolved defaults: the torch thread count, the CPU fast path's dtype."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from engine import config as config_module
from engine.cli import ProbeAccessFilter
from engine.config import EngineConfig, available_physical_cores, default_num_threads
from tests.engine.tiny_engine import make_tiny_engine


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


@pytest.mark.parametrize("cores", [1, 2, 16])
def test_default_takes_every_core_when_steps_run_in_c(monkeypatch: pytest.MonkeyPatch, cores: int) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(config_module, "available_physical_cores", lambda: cores)
    assert default_num_threads(steps_in_c=True) == cores
    assert EngineConfig().resolved_num_threads(steps_in_c=True) == cores
    assert EngineConfig(num_threads=1).resolved_num_threads(steps_in_c=True) == 1


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


@pytest.mark.parametrize("native_bf16", [True, False])
@pytest.mark.parametrize("c_builds", [True, False])
def test_cpu_kernels_choose_the_fast_paths_dtype(
    monkeypatch: pytest.MonkeyPatch, native_bf16: bool, c_builds: bool
) -> None:
    """A GGUF runs on the C kernels in float32 wherever they build, native bf16 or not; torch's
    kernels compute in bf16 where it is native: when asked for, for a checkpoint that is not a GGUF,
    or where the C kernels cannot be built."""
    monkeypatch.setattr(config_module, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(config_module.cpu_kernels, "available", lambda: c_builds)
    cpu = torch.device("cpu")
    bf16_if_native = torch.bfloat16 if native_bf16 else torch.float32
    assert EngineConfig(cpu_kernels="c").resolved_dtype(cpu) == torch.float32
    assert EngineConfig(cpu_kernels="torch").resolved_dtype(cpu) == bf16_if_native
    for model in (None, "/models/smol.Q4_1.gguf"):
        expected = torch.float32 if c_builds else bf16_if_native
        assert EngineConfig(model=model).resolved_dtype(cpu) == expected
    assert EngineConfig(model="/models/llama-hf").resolved_dtype(cpu) == bf16_if_native
    assert EngineConfig(cpu_kernels="c", dtype="bfloat16").resolved_dtype(cpu) == torch.bfloat16
    assert EngineConfig(dtype="auto").resolved_dtype(torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ValueError, match="cpu_kernels must be auto, c or torch"):
        EngineConfig(cpu_kernels="fast")


def test_a_kv_budget_too_small_for_one_block_says_which_flag() -> None:
    """The start-up error names the budget that left no room, not just that there was none."""
    with pytest.raises(RuntimeError, match=r"no room for the KV cache: --kv-cache-gib 1e-09 holds no block"):
        make_tiny_engine(num_kv_blocks=None, kv_cache_gib=1e-9)
    with pytest.raises(ValueError, match="num_kv_blocks must be positive"):
        EngineConfig(num_kv_blocks=0)


def test_speculation_stops_at_three_sequences_a_step_on_cpu_unless_told() -> None:
    """On CPU a draft row is compute: 4 streams ran slower with drafts (docs/engine.md, speculation)."""
    assert EngineConfig().resolved_speculative_max_batch(torch.device("cpu")) == 3
    assert EngineConfig().resolved_speculative_max_batch(torch.device("cuda")) == 4
    assert EngineConfig(speculative_max_batch=6).resolved_speculative_max_batch(torch.device("cpu")) == 6
