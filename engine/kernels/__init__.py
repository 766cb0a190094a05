"""Triton kernels, each with a plain-torch ``*_ref`` it is tested against.

Triton compiles only for a GPU. On a machine without CUDA, importing this package turns on
Triton's CPU interpreter (``TRITON_INTERPRET=1``) before any kernel is defined, so kernels can
still be launched on CPU tensors (slowly: tests use small shapes). The interpreter setting is
read when a kernel is decorated, which is why it has to happen here, before the kernel modules.

With CUDA, compiled kernels go to Triton's on-disk cache under the engine's cache directory
(``$XDG_CACHE_HOME/tern/triton``, beside the C kernels' builds) unless ``TRITON_CACHE_DIR`` says
otherwise, so a restarted engine's warm-up loads them instead of compiling (engine/core/warmup.py).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(cache_home, "tern", "triton"))

INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"
"""True when kernels run in Triton's CPU interpreter: no compiles, launch configs as on a GPU."""
