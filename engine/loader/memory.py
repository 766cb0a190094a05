"""Giving the heap that loading and bursts freed back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

_M_ARENA_MAX = -8
"""mallopt's parameter number for the most arenas (glibc's malloc.h)."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def use_one_malloc_arena() -> None:
    """Every thread allocates from the C library's main arena from now on; call it before the engine's
    threads start. ``malloc_trim`` hands back the free pages inside every arena but shrinks only the
    main one's top: what a thread's own arena freed at its top stays resident, up to twice the
    largest block freed so far (the engine thread's after a 2,048-token prompt's prefill: 35 MB of
    the default model requantized to Q4_K_M, served). The engine's threads allocate little at a time
    (a step's tensors), so one arena costs no contention that shows. A no-op off glibc."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is not None:
        mallopt(_M_ARENA_MAX, 1)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """libc's ``malloc_trim``, looked up once: ``find_library`` runs ``ldconfig`` (milliseconds), and the
    engine thread calls :func:`release_freed_memory` each time it goes idle."""
    trim: Callable[[int], int] | None = getattr(_libc(), "malloc_trim", None)
    return trim


def release_freed_memory() -> None:
    """Hand the heap that loading freed (float copies, the GGUF's dequantized tensors) back to the OS.
    glibc keeps freed blocks for reuse, so without this the process stays about 350 MB larger
    than what it holds. A no-op where the C library has no ``malloc_trim``."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
