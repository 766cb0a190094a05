"""Loading a model for an engine: the fast-path policy, decided once from the config.

:func:`serving_plan` turns ``EngineConfig`` (device, dtype, ``pack_cpu_linears``, ``cpu_kernels``) into
what the loader does: whether a GGUF's Q4 linears stay packed, and which CPU kernel set the linear
factory installs (``engine/loader/linear_factory.py``). :func:`load_for_engine` is ``load_model`` on
that plan: every module's form is decided before the weights are read (``engine/loader/build_plan.py``)
and no pass rewrites the model after ``load_model`` returns.
The engine only reads the outcome (``LoadedModel.steps_in_c`` for its thread count).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from engine.config import EngineConfig
from engine.cpu import ggml_kernels
from engine.cpu import kernels as cpu_kernels
from engine.loader.build_plan import CpuKernels
from engine.loader.load import LoadedModel, load_model
from engine.loader.memory import release_freed_memory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServingPlan:
    keep_gguf_int4: bool
    """A GGUF's Q4_0/Q4_1 linears stay packed (the CPU fast path runs them as they are)."""
    cpu_kernels: CpuKernels | None
    """The kernel set the linear factory installs; None leaves the loaded modules as they are."""
    keep_gguf_blocks: bool = False
    """On the C kernels: every GGUF linear, head and embedding whose GGML type has a C kernel stays in
    its own blocks (``engine/cpu/ggml_kernels.py``, ``KERNEL_TYPES``), loaded as ``GgmlLinear``."""


def serving_plan(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> ServingPlan:
    """The CPU fast path keeps a GGUF's 4-bit weights: in bf16 where the CPU has it natively, else in
    float32 activations (``--dtype auto``), on the C kernels where they build and are not turned off
    (``--cpu-kernels torch``). ``--dtype float32`` is the exact path: float weights, MKL-packed.
    Packing rewrites the model's modules, so only an engine that loads its model itself packs."""
    if device.type != "cpu" or not config.pack_cpu_linears:
        return ServingPlan(keep_gguf_int4=False, cpu_kernels=None)
    fast = dtype == torch.bfloat16 or config.dtype == "auto"
    if dtype == torch.bfloat16:
        kernels: CpuKernels | None = CpuKernels.ONEDNN_BF16
    elif dtype == torch.float32 and fast:
        use_c = config.cpu_kernels != "torch" and cpu_kernels.available()
        kernels = CpuKernels.C_F32 if use_c else CpuKernels.TORCH_INT4_F32
    elif dtype == torch.float32:
        kernels = CpuKernels.MKL_F32
    else:
        kernels = None
    return ServingPlan(keep_gguf_int4=fast, cpu_kernels=kernels, keep_gguf_blocks=kernels is CpuKernels.C_F32)


def load_for_engine(config: EngineConfig) -> LoadedModel:
    """Load the configured model (None: the default SmolLM2 GGUF) on the config's plan."""
    device = config.resolved_device()
    dtype = config.resolved_dtype(device)
    plan = serving_plan(config, device, dtype)
    loaded = load_model(
        config.model,
        device,
        dtype,
        quant=config.quant,
        keep_gguf_int4=plan.keep_gguf_int4,
        keep_gguf_blocks=plan.keep_gguf_blocks,
        cpu_kernels=plan.cpu_kernels,
    )
    if plan.keep_gguf_blocks:
        # which kernel each GGML type runs on this CPU (own blocks tiled or row by row, or Q8_0)
        loaded = replace(loaded, kernel_paths=ggml_kernels.serving_paths())
        paths = ", ".join(f"{name} {path}" for name, path in loaded.kernel_paths.items())
        log.info("GGUF types on the C kernels: %s", paths)
    release_freed_memory()
    return loaded
