"""The load plan: what each tensor of a checkpoint becomes, decided from the file's header alone,
before any of its data is read.

A GGUF file's tensor headers (name, GGML type, shape) and the loader's policy (:class:`KeepPolicy`,
from ``engine/loader/serving.py``'s ``ServingPlan``) give one :class:`TensorPlan` per tensor: its
Hugging Face name, its :class:`Form` (dequantized to float, or kept as the file's own blocks for
which kind of module), and llama.cpp's q/k row permutation to undo. :func:`gguf_plan` is the only
place these decisions are made; the reader (``gguf_file.iter_tensors``) carries them out and the
loader routes each :class:`PlannedTensor` by its form, so no decision travels in a tensor's name.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.cpu import ggml_kernels
from engine.cpu.ggml_kernels import GGMLType
from engine.families import family_for_gguf
from engine.model_config import CONFIG_TENSORS

EMBEDDING = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
_FLOAT_TYPES = {GGMLType.F32, GGMLType.F16, GGMLType.BF16}
INT4_TYPES = {GGMLType.Q4_0, GGMLType.Q4_1}
"""GGUF types a decoder linear keeps as its blocks for an ``Int4Linear`` under ``keep_int4``."""
TERNARY_TYPES = {GGMLType.TQ1_0, GGMLType.TQ2_0}
"""GGUF types a decoder linear keeps as its blocks for the ternary C kernel under ``keep_ternary``."""


class Form(enum.StrEnum):
    """What one checkpoint tensor becomes."""

    FLOAT = "float"
    """Read (dequantized where the file quantizes it) into the float model's parameter of its name."""
    INT4_BLOCKS = "int4-blocks"
    """A Q4_0/Q4_1 decoder linear's blocks, a copy: the linear becomes an ``Int4Linear``."""
    Q4_KERNEL = "q4-kernel"
    """A Q4_0/Q4_1 decoder linear's blocks, views of the file split straight into the C kernel's
    q4_1 layout as they are read (``Q4CpuLinear.from_gguf_blocks``): never unpacked to a byte a code."""
    TERNARY_BLOCKS = "ternary-blocks"
    """A TQ1_0/TQ2_0 decoder linear's blocks, a copy: the linear becomes a ``TernaryCpuLinear``."""
    GGML_BLOCKS = "ggml-blocks"
    """Blocks of a type with its own C kernel, views of the file's mapping: a ``GgmlLinear`` (an
    embedding: a ``GgmlEmbedding``)."""
    CONFIG = "config"
    """Read into the model's config, not its weights (``rope_freqs``): the reader skips it."""


@dataclass(frozen=True)
class KeepPolicy:
    """Which of a GGUF file's quantized tensors the loader keeps as their blocks."""

    int4: bool = False
    """Decoder linears stored Q4_0/Q4_1 (``--quant int4``, the CPU fast path)."""
    ternary: bool = False
    """Decoder linears stored TQ1_0/TQ2_0 (the CPU fast path where the C kernels build)."""
    blocks: bool = False
    """Every linear, head and embedding whose type has a C kernel (the C kernels' path, float32)."""
    q4_kernel: bool = False
    """With ``int4``: the Q4_0/Q4_1 linears go to the C kernel's ``Q4CpuLinear`` (the C kernels' path)
    rather than to an ``Int4Linear``."""


def keep_policy(
    *, method: str, quant: str, gguf: bool, fast_path: bool, own_blocks: bool, c_kernels: bool
) -> KeepPolicy:
    """The policy ``load_model``'s arguments ask for: ``method`` the resolved quantization, ``quant``
    the requested one, ``fast_path`` / ``own_blocks`` its ``keep_gguf_int4`` / ``keep_gguf_blocks``
    (``ServingPlan``), ``c_kernels`` whether the C kernels take the fast path's weights here."""
    int4 = method == "int4" or (fast_path and quant == "auto" and gguf)
    blocks = own_blocks and quant in ("auto", "int4") and gguf
    return KeepPolicy(int4=int4, ternary=int4 and c_kernels, blocks=blocks, q4_kernel=blocks and c_kernels)


@dataclass(frozen=True)
class TensorPlan:
    """One tensor's decided fate."""

    name: str
    """Its Hugging Face name (``model.layers.3.self_attn.q_proj.weight``)."""
    form: Form
    ggml_type: GGMLType
    """Its type in the file."""
    permuted_heads: int | None = None
    """llama.cpp's q/k row permutation to undo, over this many heads; None: rows as stored."""

    @property
    def module(self) -> str:
        """The module the tensor belongs to (its name without ``.weight`` / ``.bias``)."""
        return self.name.rpartition(".")[0]


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor of the stream the loader fills the model from, with its plan."""

    plan: TensorPlan
    tensor: torch.Tensor
    """Float for ``FLOAT``; uint8 rows of the file's blocks ``[N, bytes per row]`` otherwise."""


def float_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterable[PlannedTensor]:
    """A float checkpoint's stream (safetensors): every tensor as it is stored."""
    for name, tensor in tensors:
        yield PlannedTensor(TensorPlan(name, Form.FLOAT, GGMLType.F32), tensor)


@dataclass(frozen=True)
class TensorHeader:
    """What :func:`gguf_plan` reads of a GGUF tensor: never its data."""

    gguf_name: str
    hf_name: str
    ggml_type: GGMLType
    width: int
    """Elements per row (GGUF's innermost dimension)."""


def gguf_plan(
    headers: Iterable[TensorHeader],
    architecture: str,
    num_heads: int,
    num_kv_heads: int,
    keep: KeepPolicy,
) -> dict[str, TensorPlan]:
    """GGUF tensor name -> its plan, for every tensor of the file."""
    headers = list(headers)
    permuted = family_for_gguf(architecture).gguf_qk_permuted
    tied = not any(h.hf_name == HEAD for h in headers)
    plans = {}
    for header in headers:
        heads = None
        if permuted and (".attn_q." in header.gguf_name or ".attn_k." in header.gguf_name):
            heads = num_heads if ".attn_q." in header.gguf_name else num_kv_heads
        form = _form(header, tied, keep)
        plans[header.gguf_name] = TensorPlan(header.hf_name, form, header.ggml_type, heads)
    return plans


def holds_packed_blocks(plans: Iterable[TensorPlan]) -> bool:
    """Whether a plan keeps any linear's Q4_0/Q4_1/TQ1_0/TQ2_0 blocks for a quantized module (the model
    is then served ``int4``; a GGUF file without them stays float under ``keep_gguf_int4``)."""
    return any(plan.form in (Form.INT4_BLOCKS, Form.TERNARY_BLOCKS) for plan in plans)


def _form(header: TensorHeader, tied: bool, keep: KeepPolicy) -> Form:
    if header.gguf_name in CONFIG_TENSORS:  # rope_freqs, LongRoPE's factors: read into the config
        return Form.CONFIG
    if keep.blocks and _runs_own_blocks(header, tied):
        return Form.GGML_BLOCKS
    decoder_linear = ".layers." in header.hf_name and header.hf_name.endswith("_proj.weight")
    if decoder_linear and keep.int4 and header.ggml_type in INT4_TYPES:
        return Form.Q4_KERNEL if keep.q4_kernel else Form.INT4_BLOCKS
    if decoder_linear and keep.ternary and header.ggml_type in TERNARY_TYPES:
        return Form.TERNARY_BLOCKS
    return Form.FLOAT


def _runs_own_blocks(header: TensorHeader, tied: bool) -> bool:
    """Whether the C kernels' path keeps this tensor as its blocks (``keep.blocks``)."""
    ggml_type, name = header.ggml_type, header.hf_name
    runs = ggml_kernels.kernel_format(ggml_type, header.width) is not None
    runs = runs and ggml_kernels.serving_path(ggml_type) != "q8_0"  # measured faster converted, on this CPU
    if name == EMBEDDING:  # untied, only rows are looked up: any quantized type
        return runs or (not tied and ggml_type not in _FLOAT_TYPES)
    return runs and (name == HEAD or (".layers." in name and name.endswith("_proj.weight")))
