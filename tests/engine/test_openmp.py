"""The engine's OpenMP thread handling (engine/cpu/openmp.py): the server's step thread must be the
only OpenMP pool of the process, with the configured team size."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest
import torch

from engine.cpu import openmp

pytestmark = pytest.mark.skipif(openmp._runtime() is None, reason="the OpenMP runtime is not libgomp")


def _in_new_thread(fn: Callable[[], object]) -> object:
    """fn's result, run on a fresh thread (its OpenMP pool dies with it; pytest's own is untouched)."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def _process_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_releasing_frees_the_calling_threads_openmp_workers() -> None:
    """After a parallel op on two threads the pool keeps a worker; released, it is gone, and the
    next parallel op still computes the same result."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs for a pool with a worker")

    def run() -> tuple[int, int, bool, bool]:
        torch.set_num_threads(2)
        a = torch.randn(512, 512)
        expected = a @ a
        with_pool = _process_threads()
        released = openmp.release_openmp_threads()
        without = _process_threads()
        return with_pool, without, released, torch.allclose(a @ a, expected)

    previous = torch.get_num_threads()
    try:
        with_pool, without, released, same = _in_new_thread(run)  # type: ignore[misc]
    finally:
        torch.set_num_threads(previous)
    assert released and same
    assert without < with_pool


def test_a_new_thread_takes_the_torch_thread_count_as_its_team_size() -> None:
    """libgomp starts a new thread at every CPU whatever torch.set_num_threads said on the main
    thread; adopting the count fixes that before any torch op runs there."""
    if len(os.sched_getaffinity(0)) < 2 or os.environ.get("OMP_NUM_THREADS"):
        pytest.skip("needs libgomp's default team (every CPU) to be more than one thread")
    runtime = openmp._runtime()
    assert runtime is not None
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        before = _in_new_thread(runtime.omp_get_max_threads)

        def adopted() -> int:
            openmp.adopt_torch_thread_count()
            return runtime.omp_get_max_threads()

        after = _in_new_thread(adopted)
    finally:
        torch.set_num_threads(previous)
    assert before > 1 and after == 1


def _engine_wait_policy(flags: list[str], environ: dict[str, str]) -> tuple[list[str], str]:
    """The OMP_WAIT_POLICY libgomp reports at each start of ``tern engine flags`` (its OMP_DISPLAY_ENV
    lines: one per process image, a restart adds one), on a model that does not exist (it fails after)."""
    env = (
        {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        | environ
        | {"OMP_DISPLAY_ENV": "TRUE"}
    )
    result = subprocess.run(
        [sys.executable, "-m", "tern_cli", "engine", *flags, "--model", "/no/such.gguf"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode != 0 and "/no/such.gguf" in result.stderr, result.stderr[-2000:]
    reported = [
        line.split("=")[1].strip() for line in result.stderr.splitlines() if "OMP_WAIT_POLICY =" in line
    ]
    return reported, result.stderr[-2000:]


@pytest.mark.parametrize(
    ("flags", "environ", "expected", "starts"),
    [
        ([], {"OMP_WAIT_POLICY": "active"}, "'ACTIVE'", 1),  # the environment's own is kept
        (["--omp-wait-policy", "active"], {}, "'ACTIVE'", 2),  # a flag restarts the process with it
        (["--omp-wait-policy", "passive"], {"OMP_WAIT_POLICY": "active"}, "'PASSIVE'", 2),  # a flag wins
        (["--omp-wait-policy", "active"], {"OMP_WAIT_POLICY": "ACTIVE"}, "'ACTIVE'", 1),  # already so
    ],
)
def test_engine_runs_under_the_wait_policy_asked_for(
    flags: list[str], environ: dict[str, str], expected: str, starts: int
) -> None:
    """libgomp reads OMP_WAIT_POLICY once, when torch loads, before flags are parsed: ``tern engine``
    must run under a flag's policy all the same, restarting only when it has to (engine/cpu/openmp.py)."""
    reported, stderr = _engine_wait_policy(flags, environ)
    assert reported[-1] == expected, stderr
    assert len(reported) == starts * _openmp_runtimes_in_a_process(), stderr


def _openmp_runtimes_in_a_process() -> int:
    """How many OpenMP runtimes one process image of the engine loads, each printing OMP_DISPLAY_ENV
    once: torch's libgomp, plus one a wheel bundles under a name of its own (sentencepiece's, the
    tests' tokenizer reference, which the gguf package imports wherever it is installed)."""
    result = subprocess.run(
        [sys.executable, "-c", "import torch, gguf"],
        capture_output=True,
        text=True,
        env=os.environ | {"OMP_DISPLAY_ENV": "TRUE"},
        timeout=120,
    )
    return result.stderr.count("OMP_WAIT_POLICY =")
