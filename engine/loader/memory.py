"""Giving the heap that loading freed back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util


def release_freed_memory() -> None:
    """Hand the heap that loading freed (float copies, the GGUF's dequantized tensors) back to the OS.
    glibc keeps freed blocks for reuse, so without this the process stays about 350 MB larger
    than what it holds. A no-op where the C library has no ``malloc_trim``."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
