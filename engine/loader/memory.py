"""Giving the heap that loading freed back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """libc's ``malloc_trim``, looked up once: ``find_library`` runs ``ldconfig`` (milliseconds), and the
    engine thread calls :func:`release_freed_memory` each time it goes idle."""
    try:
        trim: Callable[[int], int] = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


def release_freed_memory() -> None:
    """Hand the heap that loading freed (float copies, the GGUF's dequantized tensors) back to the OS.
    glibc keeps freed blocks for reuse, so without this the process stays about 350 MB larger
    than what it holds. A no-op where the C library has no ``malloc_trim``."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
