"""One OpenMP thread pool per engine process: the step thread's.

libgomp (the OpenMP runtime of torch's CPU wheels, which the C kernels share) gives every thread
that opens a parallel region its own pool of workers, and keeps them after the region ends. The
server loads the model on the main thread (a pool there) and then steps on its engine thread (a
second pool). libgomp counts both pools' workers, and once it manages more threads than there are
CPUs it stops spinning at barriers and puts workers to sleep after about a thousand spins instead,
so each of the ~150 parallel regions of a decode step waits for a futex wake-up. Measured
in-process on 2 cores (same engine, steps on a second thread with the main thread's pool alive,
3 rounds): 11.7-12.7 against 9.1-11.3 ms a decode step (15-20% slower); with the main thread's
pool released first, the same as on the main thread. :func:`release_openmp_threads` releases the
calling thread's pool (OpenMP 5's ``omp_pause_resource_all``); the server calls it on the main
thread before its engine thread starts.

A new thread's OpenMP team size is libgomp's default too (every CPU), not what
``torch.set_num_threads`` (``--num-threads``) set on the main thread: torch fixes it per thread only
on its first large op. :func:`adopt_torch_thread_count` sets it at once, so the C kernels of a
step thread that has not run one yet use the configured count.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1
"""``omp_pause_soft``: free the threads, keep what a later parallel region needs to start again."""


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The process's libgomp (torch loads it first, so this finds the same one), or None."""
    try:
        runtime = ctypes.CDLL("libgomp.so.1")
        runtime.omp_pause_resource_all.argtypes = [ctypes.c_int]
    except (OSError, AttributeError):  # another OpenMP runtime, or one before OpenMP 5
        return None
    return runtime


def release_openmp_threads() -> bool:
    """Free the OpenMP worker threads of the calling thread's pool (a later parallel region on it
    starts new ones). Returns whether the runtime did so."""
    runtime = _runtime()
    if runtime is None:
        return False
    released = runtime.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
    if not released:
        log.debug("the OpenMP runtime kept this thread's workers (inside a parallel region?)")
    return released


def adopt_torch_thread_count() -> None:
    """Make the calling thread's OpenMP team size the process's torch thread count."""
    torch.set_num_threads(torch.get_num_threads())


WAIT_POLICIES = ("active", "passive")
"""``--omp-wait-policy``: libgomp's ``OMP_WAIT_POLICY``. Unset (the default), a worker spins at a barrier
(300,000 times) before it sleeps, ``active`` spins without end, ``passive`` sleeps at once: a futex
wake-up a parallel region, but no core burnt spinning while the thread it waits for is descheduled,
which on a machine whose cores something else also wants turns each of a step's ~150 barriers into a
scheduler slice. Measured (docs/engine.md, "The 1-stream stalls"): on a busy 2-core machine a 1B Q4_K_M
decode step at 2 threads took 92-185 ms of CPU and p99 1.2-2.2 s spinning, 31-39 ms and p99 41-162 ms
passive; but near idle the default model's one-row step took 6.6 ms passive against 3.2 spinning (p50),
so the default stays libgomp's and passive is for machines shared with other work."""


def restart_with_wait_policy(policy: str | None, engine_argv: Sequence[str]) -> None:
    """Run ``tern engine`` again (``python -m engine.cli engine_argv``) with ``OMP_WAIT_POLICY`` set to
    ``policy``, unless ``policy`` is None or the environment already holds it: libgomp reads it once,
    when torch's import loads it, before any flag is parsed. Returns only where no restart is needed."""
    current = os.environ.get("OMP_WAIT_POLICY", "").lower()
    if policy is None or current == policy:
        return
    env = os.environ | {"OMP_WAIT_POLICY": policy.upper()}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "engine.cli", *engine_argv], env)
