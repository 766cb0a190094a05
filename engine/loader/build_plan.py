"""The build plan: each module's final form, decided from the config and the serving plan's kernel
set before any weight is read, and put on the modules as the model is built (not after it is filled).

Where :mod:`engine.loader.plan` decides what each *tensor* of a GGUF file becomes, this decides what
each *module* runs: per layer its norm and activation (torch, or the C kernel), its rope variant and
sliding window (from the config, as the model's constructor lays them out), and its attention layer's
decode backend; for the model, whether q/k/v and gate/up are stacked and which linear table
(``engine/loader/linear_factory.py``) finishes it. :func:`decode_backend` is the one place the decode
backend is decided; :func:`apply_forms` the one place it and the C-kernel flags are put on modules.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.activation import GeluTanhAndMul, SiluAndMul
from engine.layers.attention import Attention
from engine.layers.attention_backends import CDecode, DecodeBackend, TorchDecode, TritonDecode
from engine.layers.norm import RMSNorm
from engine.model_config import ModelConfig
from engine.models.llama import LlamaModel


class CpuKernels(enum.StrEnum):
    """The CPU kernel set a model is served on; the serving plan picks one per engine (serving.py)."""

    MKL_F32 = "mkl-f32"
    ONEDNN_BF16 = "onednn-bf16"
    TORCH_INT4_F32 = "torch-int4-f32"
    C_F32 = "c-f32"


FUSES_PROJECTIONS = {CpuKernels.ONEDNN_BF16, CpuKernels.TORCH_INT4_F32, CpuKernels.C_F32}
"""Kernel sets that first stack q/k/v and gate/up into one linear each (fewer, wider GEMMs; the exact
MKL path keeps the checkpoint's shapes)."""


class DecodeBackendKind(enum.StrEnum):
    """Which :class:`DecodeBackend` an attention layer reads the paged cache with."""

    TORCH = "torch"
    TRITON = "triton"
    """CUDA: the Triton paged-attention kernel."""
    C = "c"
    """The float32 CPU fast path (``CpuKernels.C_F32``): the C kernel over a float16 cache."""


class OpForm(enum.StrEnum):
    """How an RMSNorm or a SiLU-and-mul runs."""

    TORCH = "torch"
    C = "c"
    """One C call (``engine/cpu``), the one the C decoder layer makes too: both paths round alike."""


class RopeVariant(enum.StrEnum):
    FULL = "full"
    """Rotary over every dim of a head, from the model's rotary table."""
    PARTIAL = "partial"
    """Rotary over the leading ``rotary_dim`` dims only (Phi-4-mini)."""
    LOCAL = "local"
    """The local rotary table (Gemma 3's sliding layers: their own base, no scaling)."""
    NOPE = "nope"
    """No rotary (SmolLM3's ``no_rope_layers``)."""


@dataclass(frozen=True)
class LayerPlan:
    norm: OpForm
    """The layer's RMSNorms (input, post-attention, Qwen3's q/k, BitNet's sub-norms)."""
    activation: OpForm
    rope: RopeVariant
    window: int | None
    """The sliding window its attention sees, or None: the whole context."""
    decode: DecodeBackendKind


@dataclass(frozen=True)
class BuildPlan:
    kernels: CpuKernels | None
    """The CPU linear table that finishes the model after the fill; None: linears stay as loaded."""
    fuse_projections: bool
    """q/k/v and gate/up stacked into one linear each, before the linear table runs."""
    final_norm: OpForm
    layers: tuple[LayerPlan, ...]

    @property
    def c_forms(self) -> bool:
        """Whether any module takes its C kernel (the one-call decoder layer is then tried)."""
        return self.final_norm is OpForm.C


def decode_backend(device: torch.device, kernels: CpuKernels | None) -> DecodeBackendKind:
    """The one place a model's decode backend is decided: Triton on CUDA, the C kernel on the float32
    CPU fast path's C kernels, the torch gather elsewhere."""
    if device.type == "cuda":
        return DecodeBackendKind.TRITON
    if kernels is CpuKernels.C_F32:
        return DecodeBackendKind.C
    return DecodeBackendKind.TORCH


def build_plan(config: ModelConfig, device: torch.device, kernels: CpuKernels | None) -> BuildPlan:
    """Every module's form, from the config, the device and the serving plan's kernel set alone."""
    op = OpForm.C if kernels is CpuKernels.C_F32 else OpForm.TORCH
    decode = decode_backend(device, kernels)
    nope, sliding = set(config.nope_layers), set(config.sliding_layers)
    local = sliding if config.rope_local_theta is not None else set()
    partial = config.rotary_dim is not None and config.rotary_dim != config.head_dim
    layers = []
    for index in range(config.num_hidden_layers):
        if index in nope:
            rope = RopeVariant.NOPE
        elif index in local:
            rope = RopeVariant.LOCAL
        else:
            rope = RopeVariant.PARTIAL if partial else RopeVariant.FULL
        window = config.sliding_window if index in sliding else None
        layers.append(LayerPlan(norm=op, activation=op, rope=rope, window=window, decode=decode))
    return BuildPlan(
        kernels=kernels,
        fuse_projections=kernels in FUSES_PROJECTIONS,
        final_norm=op,
        layers=tuple(layers),
    )


_BACKENDS: dict[DecodeBackendKind, type[TorchDecode | TritonDecode | CDecode]] = {
    DecodeBackendKind.TORCH: TorchDecode,
    DecodeBackendKind.TRITON: TritonDecode,
    DecodeBackendKind.C: CDecode,
}


def apply_forms(model: nn.Module, plan: BuildPlan) -> None:
    """Put the plan's forms on ``model``'s modules: needs the modules, never their weights, so the
    loader calls it right after building the model on the meta device. Layer by layer for each Llama
    model inside ``model``; the model's own norms (the final one) take ``plan.final_norm``. Backends
    are stateless: one instance of each serves every layer that holds it."""
    backends: dict[DecodeBackendKind, DecodeBackend] = {}
    in_layers: set[int] = set()
    for llama in (m for m in model.modules() if isinstance(m, LlamaModel)):
        if len(llama.layers) != len(plan.layers):
            raise ValueError(f"a build plan of {len(plan.layers)} layers for a model of {len(llama.layers)}")
        for layer, layer_plan in zip(llama.layers, plan.layers, strict=True):
            decode = layer_plan.decode
            backend = backends.setdefault(decode, _BACKENDS[decode]())
            for module in layer.modules():
                _apply(module, layer_plan.norm, layer_plan.activation, backend)
                in_layers.add(id(module))
    for module in model.modules():
        if id(module) not in in_layers:
            _apply(module, plan.final_norm, plan.final_norm, None)


def _apply(module: nn.Module, norm: OpForm, activation: OpForm, backend: DecodeBackend | None) -> None:
    if isinstance(module, RMSNorm):
        module.c_kernel = norm is OpForm.C
    elif isinstance(module, SiluAndMul | GeluTanhAndMul):
        module.c_kernel = activation is OpForm.C
    elif isinstance(module, Attention) and backend is not None and type(module.backend) is not type(backend):
        module.backend = backend
