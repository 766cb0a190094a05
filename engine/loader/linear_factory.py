"""The linear factory: which module runs each linear of a loaded model, one table keyed by the
weight's format and the CPU kernel set the loader chose (``engine/loader/serving.py``).

The loader calls :func:`finish_linears` once, after the weights are in, on the build plan it decided
before reading them (``engine/loader/build_plan.py``, which also put the norms', activation's and
decode attention's forms on the modules as they were built). For every linear it looks up
``LINEAR_KERNELS[kernels][weight_format(module)]``: a tuple of candidates (module classes), tried in
order; the first whose ``supports(module)`` holds replaces the module (``Class(module)``), and
where none does, or the format has no row, the module stays as it was loaded. Nothing is decided
per call afterwards: a replaced module runs its one kernel.

Weight formats (:class:`WeightFormat`, found by the module's exact type in ``MODULE_FORMATS``):

- ``FLOAT``: ``nn.Linear`` (float checkpoints, and GGUF tensors the reader dequantized, such as the
  default model's Q8_0 tied embedding / lm_head);
- ``INT4``: ``Int4Linear``, group-wise ``code * scale + min``: GGML Q4_0 and Q4_1 blocks kept as they
  are (``keep_gguf_int4``) off the C kernels, AutoAWQ GEMM checkpoints, RTN-quantized float
  checkpoints. On ``C_F32`` a GGUF's Q4_0/Q4_1 linears load straight into ``Q4CpuLinear`` (the load
  plan's ``Form.Q4_KERNEL``, ``engine/loader/plan.py``), which needs no row;
- ``TERNARY``: ``TernaryLinear`` (BitNet b1.58, a float checkpoint ternarized with ``--quant bitnet``):
  ``C_F32`` runs it on the ternary C kernel (``TernaryCpuLinear``, two bits a weight). A TQ1_0/TQ2_0
  GGUF's linears and a packed BitNet checkpoint's load straight into ``TernaryCpuLinear`` on the fast
  path (``keep_gguf_int4``), which needs no row.
- ``GGML``: ``GgmlLinear``, a GGUF tensor's own blocks of a type that has a C kernel (Q4_K, Q5_K,
  Q6_K, Q8_0, Q5_0): which kernel runs which GGML type is the one table
  ``engine/cpu/ggml_kernels.py``'s ``KERNEL_TYPES``. The loader keeps these blocks only for ``C_F32``
  (``ServingPlan.keep_gguf_blocks``), and the module runs its kernel as loaded: no row replaces it.

Kernel sets (:class:`CpuKernels`): ``MKL_F32`` (the exact float32 path, weights also MKL-packed),
``ONEDNN_BF16`` (bf16 on a CPU with native bf16), ``TORCH_INT4_F32`` (torch's int4/int8 kernels in a
float32 model) and ``C_F32`` (the C kernels of ``engine/cpu``: with them RMSNorm, SiLU-and-mul and
decode attention take their C kernels too, and a Llama model runs every layer of a decode step in one
C call).

How a new GGML type's kernel plugs in (say IQ4_NL, with a C kernel in ``engine/cpu``):

1. The kernel and its plain-torch reference in ``engine/cpu`` (``kquant_kernels.c`` and
   ``ggml_kernels.py``'s ctypes call and ``matmul_ref``), tested against each other.
2. One entry in ``engine/cpu/ggml_kernels.py``'s ``KERNEL_TYPES`` (GGML type -> ``KernelFormat``). From
   then on the load plan keeps that type's blocks on ``C_F32`` (``ServingPlan.keep_gguf_blocks``,
   ``Form.GGML_BLOCKS`` in ``engine/loader/plan.py``), the loader installs them as a ``GgmlLinear``,
   and that module runs the kernel: no row here is needed. If the one-call decoder layer should run
   it too, its ``c_id`` is handled in ``layer_kernels.c`` (``engine/models/llama_decode_kernel.py``).
3. A kernel for a module kind of its own (not GGUF blocks: say an FP8 checkpoint's linears) is a new
   ``WeightFormat``, its module type in ``MODULE_FORMATS``, a drop-in CPU linear in ``engine/layers``
   with a ``supports(module) -> bool`` staticmethod (as ``Q4CpuLinear`` in packed_linear.py), and
   one row: ``LINEAR_KERNELS[CpuKernels.C_F32][WeightFormat.FP8] = (Fp8CpuLinear,)``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from engine.layers.ggml_linear import GgmlLinear
from engine.layers.packed_linear import (
    Bf16Embedding,
    Int4PackedCpuLinear,
    Int8PackedCpuLinear,
    MklPackedLinear,
    OneDnnPackedLinear,
    Q4CpuLinear,
    Q8CpuLinear,
    Q8Embedding,
    activation_dtype,
)
from engine.layers.quant.linear import Int4Linear, TernaryLinear
from engine.layers.ternary_linear import FROM_TERNARY_LINEAR
from engine.loader.build_plan import FUSES_PROJECTIONS, BuildPlan, CpuKernels, apply_forms, build_plan
from engine.model_config import ModelConfig

__all__ = ["FUSES_PROJECTIONS", "CpuKernels", "Installed", "finish_linears", "install_cpu_kernels"]


class WeightFormat(enum.StrEnum):
    FLOAT = "float"
    INT4 = "int4"
    TERNARY = "ternary"
    GGML = "ggml"


MODULE_FORMATS: dict[type[nn.Module], WeightFormat] = {
    nn.Linear: WeightFormat.FLOAT,
    Int4Linear: WeightFormat.INT4,
    TernaryLinear: WeightFormat.TERNARY,
    GgmlLinear: WeightFormat.GGML,
}


@runtime_checkable
class FusesProjections(Protocol):
    """A model that can stack q/k/v and gate/up into one linear each (engine/models/llama.py)."""

    def fuse_projections(self) -> int: ...


class CpuLinear(Protocol):
    """What a row of the table holds: a drop-in module class built from the module it replaces."""

    def __call__(self, module: nn.Module, /) -> nn.Module: ...
    def supports(self, module: nn.Module, /) -> bool: ...


M = TypeVar("M", bound=nn.Module)
_FromFloat = MklPackedLinear | OneDnnPackedLinear | Int8PackedCpuLinear | Q8CpuLinear
_FromInt4 = Int4PackedCpuLinear | Q4CpuLinear


class _Candidate(Generic[M]):
    """A module class as a row's candidate: its own ``supports`` and constructor, which take the one
    module type the row's format names (``MODULE_FORMATS``); typed for any module, as rows are read."""

    def __init__(self, cls: Callable[[M], nn.Module], supports: Callable[[M], bool], takes: type[M]) -> None:
        self.cls, self._supports, self.takes = cls, supports, takes

    def supports(self, module: nn.Module, /) -> bool:
        return isinstance(module, self.takes) and self._supports(module)

    def __call__(self, module: nn.Module, /) -> nn.Module:
        if not isinstance(module, self.takes):
            raise TypeError(f"{self.cls} takes a {self.takes.__name__}, not a {type(module).__name__}")
        return self.cls(module)

    def __repr__(self) -> str:
        return f"_Candidate({getattr(self.cls, '__name__', self.cls)})"


def _on_float(cls: type[_FromFloat]) -> CpuLinear:
    return _Candidate(cls, cls.supports, nn.Linear)


def _on_int4(cls: type[_FromInt4]) -> CpuLinear:
    return _Candidate(cls, cls.supports, Int4Linear)


LINEAR_KERNELS: dict[CpuKernels, dict[WeightFormat, tuple[CpuLinear, ...]]] = {
    CpuKernels.MKL_F32: {WeightFormat.FLOAT: (_on_float(MklPackedLinear),)},
    CpuKernels.ONEDNN_BF16: {
        WeightFormat.FLOAT: (_on_float(OneDnnPackedLinear),),
        WeightFormat.INT4: (_on_int4(Int4PackedCpuLinear),),
    },
    CpuKernels.TORCH_INT4_F32: {
        WeightFormat.FLOAT: (_on_float(Int8PackedCpuLinear),),
        WeightFormat.INT4: (_on_int4(Int4PackedCpuLinear),),
    },
    CpuKernels.C_F32: {
        WeightFormat.FLOAT: (_on_float(Q8CpuLinear), _on_float(Int8PackedCpuLinear)),
        WeightFormat.INT4: (_on_int4(Q4CpuLinear), _on_int4(Int4PackedCpuLinear)),
        WeightFormat.TERNARY: (FROM_TERNARY_LINEAR,),
    },
}
"""kernel set -> weight format -> candidate classes, the first that ``supports`` the module wins."""


def weight_format(module: nn.Module) -> WeightFormat | None:
    return MODULE_FORMATS.get(type(module))


@dataclass(frozen=True)
class Installed:
    """What :func:`install_cpu_kernels` did to a model."""

    replaced: int
    """Linears replaced by the table's modules."""
    steps_in_c: bool
    """Decode steps run as one C call (``engine/models/llama_decode_kernel.py``); threads follow it."""


def install_cpu_kernels(model: nn.Module, kernels: CpuKernels) -> Installed:
    """Replace ``model``'s CPU linears by ``kernels``' modules, in place (module weights on CPU; float
    linears only in the model's own dtype). With ``C_F32`` the norms, activation and decode attention
    take their C kernels too (the build plan's forms, ``engine/loader/build_plan.py``), an embedding is
    looked up from a tied Q8_0 lm_head's blocks where they give it back exactly, else kept in bfloat16
    where that holds it exactly, and Llama layers get the one-call decode kernel. The loader does the
    same in two steps around the fill (``load_model(cpu_kernels=...)``); this is for a model built
    another way."""
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        raise TypeError(f"install_cpu_kernels needs a model with a ModelConfig, not {type(model).__name__}")
    plan = build_plan(config, torch.device("cpu"), kernels)
    if plan.c_forms:
        apply_forms(model, plan)
    return finish_linears(model, plan)


def finish_linears(model: nn.Module, plan: BuildPlan) -> Installed:
    """The plan's linear table on a filled model: q/k/v and gate/up stacked where the kernel set
    stacks them, each linear replaced by the first row candidate that supports it; with the C forms,
    the embedding compacted and the one-call decoder layer attached (it checks the forms
    :func:`apply_forms` put on the modules at build)."""
    kernels = plan.kernels
    if kernels is None:
        return Installed(0, steps_in_c=False)
    dtype = activation_dtype(model)
    if plan.fuse_projections and isinstance(model, FusesProjections):
        model.fuse_projections()
    table = LINEAR_KERNELS[kernels]
    replaced = 0
    for name, module in list(model.named_modules()):
        fmt = weight_format(module)
        if fmt is None or fmt not in table:
            continue
        if fmt is WeightFormat.FLOAT and (module.weight.device.type != "cpu" or module.weight.dtype != dtype):
            continue
        for cls in table[fmt]:
            if cls.supports(module):
                model.set_submodule(name, cls(module))
                replaced += 1
                break
    if not plan.c_forms:
        return Installed(replaced, steps_in_c=False)
    _compact_embeddings(model)
    from engine.models.llama_decode_kernel import attach_decoder_kernels

    return Installed(replaced, steps_in_c=attach_decoder_kernels(model))


def _compact_embeddings(model: nn.Module) -> None:
    """Swap an embedding for a :class:`Q8Embedding` on its tied lm_head's blocks where they give it
    back exactly (a GGUF's Q8_0 table), else for a :class:`Bf16Embedding` where bfloat16 does (a bf16
    checkpoint's table beside its head's Q8_0 copy); the float32 table is then freed. Every input row
    stays bit for bit what it was."""
    embeddings = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Embedding)]
    heads = [m for m in model.modules() if isinstance(m, Q8CpuLinear)]
    for name, embedding in embeddings:
        table = embedding.weight.detach()
        head = next((h for h in heads if Q8Embedding.represents(h, table)), None)
        if head is not None:
            model.set_submodule(name, Q8Embedding(head))
        elif not _shared(model, embedding) and Bf16Embedding.represents(table):
            model.set_submodule(name, Bf16Embedding(table))


def _shared(model: nn.Module, embedding: nn.Embedding) -> bool:
    """Whether another module still holds the embedding's float table (a tied head left in float):
    a bfloat16 copy would then add to it, not replace it."""
    return any(
        p is embedding.weight
        for m in model.modules()
        if m is not embedding
        for p in m.parameters(recurse=False)
    )
