"""Triton kernels, each with a plain-torch ``*_ref`` it is tested against.

Triton compiles only for a GPU. On a machine without CUDA, importing this package turns on
Triton's CPU interpreter (``TRITON_INTERPRET=1``) before any kernel is defined, so kernels can
still be launched on CPU tensors (slowly: tests use small shapes). The interpreter setting is
read when a kernel is decorated, which is why it has to happen here, before the kernel modules.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"
"""True when kernels run in Triton's CPU interpreter: fixed launch configs, no autotuning."""
