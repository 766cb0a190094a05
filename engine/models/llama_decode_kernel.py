"""A Llama model's decoder layers over decode rows in one C call (``tern_decoder_layers``,
layer_kernels.c): Llama, Qwen3, SmolLM3, Phi-3, BitNet b1.58 and Gemma 3 layers.

On the float32 fast path a decode step at one stream spent about as long in Python and small torch
ops between the kernels as in the kernels, and then, with one call per layer, still a tenth of the
step in the Python around the 30 calls. For a step whose rows are all decode rows (no prompt
chunk), :class:`DecoderLayersKernel` runs every layer in C: the same kernels and the same float32
arithmetic as the layers' torch path, so a row comes out bit for bit the same either way (tested),
and mixed steps keep the torch path. :func:`attach_decoder_kernels` gives a model whose layers are
all plain Llama layers with their linears on the C kernels one. Gemma 3's sliding-window layers read
the step's local view (their own pool's slots and block tables, ``Context.local``) and their own rotary
tables, as its torch layers do.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from typing import Protocol, cast

import torch
from torch import nn

from engine.cpu import kernels as cpu_kernels
from engine.cpu.ggml_kernels import KERNEL_TYPES, TILED_FORMATS
from engine.layers.activation import GeluTanhAndMul, SiluAndMul
from engine.layers.attention_backends import CDecode
from engine.layers.context import Context, get_context
from engine.layers.ggml_linear import StackedLinear
from engine.layers.linear_protocol import Linear
from engine.layers.ternary_linear import TernaryCpuLinear
from engine.models.bitnet import BitNetAttention, BitNetDecoderLayer, BitNetMLP
from engine.models.gemma3 import Gemma3DecoderLayer
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel, Rope
from engine.models.phi3 import Phi3Attention, Phi3DecoderLayer, Phi3MLP

# format -> its number in decoder_layer.h (FORMAT_*); the GGML types' come from ggml_kernels.KERNEL_TYPES.
_FORMATS = {"q4_1": 1, TernaryCpuLinear.format: 5} | {
    spec.name: spec.c_id for spec in (*KERNEL_TYPES.values(), *TILED_FORMATS.values())
}


class _Linear(ctypes.Structure):
    pass


_Linear._fields_ = [
    ("qweight", ctypes.c_void_p),
    ("scales", ctypes.c_void_p),
    ("mins", ctypes.c_void_p),
    ("bias", ctypes.c_void_p),
    ("out_features", ctypes.c_int64),
    ("in_features", ctypes.c_int64),
    ("format", ctypes.c_int32),
    ("next", ctypes.POINTER(_Linear)),  # a StackedLinear's next part, or NULL
    ("row_scales", ctypes.c_void_p),  # ternary: [N] float32, or NULL (block scales in `scales`)
]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("half", ctypes.c_int32),
        ("block_size", ctypes.c_int64),
        ("attn_sub_norm", ctypes.c_void_p),  # BitNet only, else NULL
        ("ffn_sub_norm", ctypes.c_void_p),
        ("activation", ctypes.c_int32),  # _ACTIVATIONS
        ("q_norm", ctypes.c_void_p),  # Qwen3, Gemma 3, else NULL
        ("k_norm", ctypes.c_void_p),
        ("rotary", ctypes.c_int32),  # rotary dims (Phi-4-mini: 3/4 of the head); 0 on a NoPE layer (SmolLM3)
        ("attn_out_norm", ctypes.c_void_p),  # Gemma 3 only (its post_attention_layernorm), else NULL
        ("mlp_out_norm", ctypes.c_void_p),  # Gemma 3 only (its post_feedforward_layernorm), else NULL
        ("window", ctypes.c_int64),  # a sliding-window layer's window (its own pool), else 0
        ("local_rope", ctypes.c_int32),  # rotary from the local layers' tables (Gemma 3's local layers)
    ]


class _Step(ctypes.Structure):
    """decoder_layer.h's TernDecodeStep: a decode step's rows, in the main pool and in the sliding-window
    layers' own (the main pool's again where the step has no local view)."""

    _fields_ = [
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("local_cos", ctypes.c_void_p),
        ("local_sin", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("slots", ctypes.c_void_p),
        ("local_slots", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("local_tables", ctypes.c_void_p),
        ("width", ctypes.c_int64),
        ("local_width", ctypes.c_int64),
        ("context_lens", ctypes.c_void_p),
    ]


# The MLP's gated activation -> its number in decoder_layer.h (ACT_*); BitNet's squared ReLU is 1.
_ACTIVATIONS = {SiluAndMul: 0, GeluTanhAndMul: 2}
_RELU2 = 1


def _on_c_kernel(linear: nn.Module | None) -> bool:
    if isinstance(linear, StackedLinear):
        return all(map(_on_c_kernel, linear.parts))
    return getattr(linear, "format", None) in _FORMATS


class _CKernelLinear(Linear, Protocol):
    """What a linear on a C kernel holds (``GgmlLinear``, ``Q4CpuLinear``, ``TernaryCpuLinear``, a
    ``StackedLinear`` of them): what :func:`supports` checked with :func:`_on_c_kernel`."""

    qweight: torch.Tensor
    scales: torch.Tensor | None
    bias: torch.Tensor | None


def _c_linear(module: nn.Module | None) -> _CKernelLinear:
    if module is None:
        raise cpu_kernels.KernelError("the decoder layer kernel needs q/k/v and gate/up stacked")
    return cast(_CKernelLinear, module)


def _linear(module: nn.Module | None, keep: list[_Linear]) -> _Linear:
    """The C struct of a linear; a StackedLinear's parts chained through ``next``, their structs
    appended to ``keep`` (the caller holds them as long as the layers' structs)."""

    def address(tensor: torch.Tensor | None) -> int | None:
        return None if tensor is None else tensor.data_ptr()

    if isinstance(module, StackedLinear):
        structs = [_linear(part, keep) for part in module.parts]
        keep.extend(structs)
        for struct, following in itertools.pairwise(structs):
            struct.next = ctypes.pointer(following)
        return structs[0]
    linear = _c_linear(module)
    return _Linear(
        address(linear.qweight),
        address(linear.scales),
        address(getattr(linear, "mins", None)),
        address(linear.bias),
        linear.out_features,
        linear.in_features,
        _FORMATS[linear.format],
        None,
        address(getattr(linear, "row_scales", None)),
    )


_LAYER_TYPES = {
    LlamaDecoderLayer: (LlamaAttention, LlamaMLP),
    BitNetDecoderLayer: (BitNetAttention, BitNetMLP),
    Phi3DecoderLayer: (Phi3Attention, Phi3MLP),  # Llama's layer with its projections fused as stored
    Gemma3DecoderLayer: (LlamaAttention, LlamaMLP),  # Llama's blocks, with norms after them too
}


def supports(layer: nn.Module) -> bool:
    """Whether the C layer computes exactly what ``layer``'s torch path does."""
    if type(layer) not in _LAYER_TYPES or not isinstance(layer, LlamaDecoderLayer):
        return False
    attention, mlp = layer.self_attn, layer.mlp
    if isinstance(layer, BitNetDecoderLayer):
        if not isinstance(attention, BitNetAttention) or not isinstance(mlp, BitNetMLP):
            return False
        sub_norms = (attention.attn_sub_norm, mlp.ffn_sub_norm)
        if not all(norm.c_kernel and norm.eps == layer.input_layernorm.eps for norm in sub_norms):
            return False
    other_norms = [norm for norm in (attention.q_norm, attention.k_norm) if norm is not None]
    if isinstance(layer, Gemma3DecoderLayer):
        other_norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    if not all(norm.c_kernel and norm.eps == layer.input_layernorm.eps for norm in other_norms):
        return False  # the struct holds one eps, and the C path calls the C norm
    return (
        (type(attention), type(mlp)) == _LAYER_TYPES[type(layer)]
        and _on_c_kernel(attention.qkv_proj)
        and _on_c_kernel(attention.o_proj)
        and _on_c_kernel(mlp.gate_up_proj)
        and _on_c_kernel(mlp.down_proj)
        and isinstance(attention.attn.backend, CDecode)
        and type(mlp.act) in _ACTIVATIONS  # what the C layer computes (BitNet's: its own)
        and cast(SiluAndMul | GeluTanhAndMul, mlp.act).c_kernel  # the C kernel on the torch path too
        and layer.input_layernorm.c_kernel
        and layer.post_attention_layernorm.c_kernel
        and layer.input_layernorm.eps == layer.post_attention_layernorm.eps  # the struct holds one
    )


def _layer_struct(layer: LlamaDecoderLayer, keep: list[_Linear], *, local_rope: bool) -> _Layer:
    attention, mlp = layer.self_attn, layer.mlp
    k_cache, v_cache = attention.attn.k_cache, attention.attn.v_cache
    if k_cache.dtype not in (torch.float16, torch.float32):
        raise cpu_kernels.KernelError("the decoder layer kernel takes a float16 or float32 cache")
    pre_mlp, attn_out, mlp_out = _norms(layer)
    return _Layer(
        _linear(attention.qkv_proj, keep),
        _linear(attention.o_proj, keep),
        _linear(mlp.gate_up_proj, keep),
        _linear(mlp.down_proj, keep),
        layer.input_layernorm.weight.data_ptr(),
        pre_mlp,
        layer.input_layernorm.eps,
        attention.attn.scale,
        attention.num_heads,
        attention.num_kv_heads,
        attention.head_dim,
        _c_linear(mlp.gate_up_proj).out_features // 2,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        int(k_cache.dtype == torch.float16),
        k_cache.shape[1],
        *_bitnet_norms(layer),
        _activation(mlp),
        *_head_norms(attention),
        attention.rotary_dim if attention.rotary else 0,
        attn_out_norm=attn_out,
        mlp_out_norm=mlp_out,
        window=attention.attn.window or 0,
        local_rope=int(local_rope),
    )


def _norms(layer: LlamaDecoderLayer) -> tuple[int, int | None, int | None]:
    """The norm before the MLP, and Gemma 3's norms of the attention's and the MLP's outputs (NULLs for
    a layer without them). Gemma's ``post_attention_layernorm`` is the first of those, where Llama's is
    the norm before the MLP (Gemma's ``pre_feedforward_layernorm``)."""
    if isinstance(layer, Gemma3DecoderLayer):
        return (
            layer.pre_feedforward_layernorm.weight.data_ptr(),
            layer.post_attention_layernorm.weight.data_ptr(),
            layer.post_feedforward_layernorm.weight.data_ptr(),
        )
    return layer.post_attention_layernorm.weight.data_ptr(), None, None


def _head_norms(attention: LlamaAttention) -> tuple[int | None, int | None]:
    """Qwen3's and Gemma 3's per-head q and k norms' weights; NULLs for a layer without them."""
    if attention.q_norm is None or attention.k_norm is None:
        return None, None
    return attention.q_norm.weight.data_ptr(), attention.k_norm.weight.data_ptr()


def _bitnet_norms(layer: LlamaDecoderLayer) -> tuple[int | None, int | None]:
    """A BitNet layer's sub-norms (engine/models/bitnet.py); NULLs for a Llama layer."""
    if not isinstance(layer, BitNetDecoderLayer):
        return None, None
    attention, mlp = layer.self_attn, layer.mlp
    assert isinstance(attention, BitNetAttention) and isinstance(mlp, BitNetMLP)
    return attention.attn_sub_norm.weight.data_ptr(), mlp.ffn_sub_norm.weight.data_ptr()


def _activation(mlp: LlamaMLP) -> int:
    if isinstance(mlp, BitNetMLP) and mlp.relu2:
        return _RELU2
    return _ACTIVATIONS[type(mlp.act)]


def _step(ctx: Context, rope: Rope, local_rope: Rope, keep: list[torch.Tensor]) -> _Step:
    """The step's rows for the C call; the tensors it points to are appended to ``keep``. The sliding-
    window layers read ``ctx.local`` where the step has one, as their torch path does (attention.py)."""
    local = ctx.local or ctx
    tables = (*rope, *local_rope)
    stride = tables[0].stride(0)
    if any(t.dtype != torch.float32 or t.stride(-1) != 1 or t.stride(0) != stride for t in tables):
        raise cpu_kernels.KernelError("the decoder layers take float32 rotary tables, rows equally apart")
    slots = [c.slot_mapping.to(torch.int64).contiguous() for c in (ctx, local)]  # type: ignore[union-attr]
    blocks = [c.block_tables.to(torch.int32).contiguous() for c in (ctx, local)]  # type: ignore[union-attr]
    lens = ctx.context_lens.to(torch.int32).contiguous()  # type: ignore[union-attr]
    keep.extend([*slots, *blocks, lens])
    return _Step(
        *(t.data_ptr() for t in tables),
        stride,
        *(t.data_ptr() for t in slots),
        *(t.data_ptr() for t in blocks),
        *(t.shape[1] for t in blocks),
        lens.data_ptr(),
    )


class DecoderLayersKernel:
    """Runs ``layers`` for a pure decode step in one C call; None (the caller takes the torch path)
    for any other step. The C structs hold the weights' and the caches' addresses; they are rebuilt
    when the model runner hands the layers another cache. ``local_layers`` (indices) take the local
    rotary tables (Gemma 3's sliding-window layers: their own base)."""

    def __init__(
        self, layers: Sequence[LlamaDecoderLayer], local_layers: frozenset[int] = frozenset()
    ) -> None:
        self.layers = list(layers)
        self.local_layers = local_layers
        # Looked up once: nn.Module attribute lookups over 30 layers cost ~0.1 ms a step.
        self._attentions = [layer.self_attn.attn for layer in self.layers]
        self._structs: ctypes.Array | None = None
        self._caches: list[int] = []

    def _layer_structs(self) -> ctypes.Array:
        # Every layer's cache, not just the first: a struct left pointing at a freed cache would
        # have the kernel write into memory it no longer owns.
        caches = [t.data_ptr() for a in self._attentions for t in (a.k_cache, a.v_cache)]
        if self._structs is None or caches != self._caches:
            self._parts: list[_Linear] = []
            structs = [
                _layer_struct(layer, self._parts, local_rope=i in self.local_layers)
                for i, layer in enumerate(self.layers)
            ]
            self._structs = (_Layer * len(structs))(*structs)
            self._caches = caches
        return self._structs

    def __call__(self, hidden: torch.Tensor, rope: Rope, local_rope: Rope) -> torch.Tensor | None:
        ctx = get_context()
        uncached = self._attentions[0].k_cache.numel() == 0
        if ctx.num_seqs == 0 or ctx.is_prefill or uncached or hidden.dtype != torch.float32:
            return None
        keep: list[torch.Tensor] = []
        step = _step(ctx, rope, local_rope, keep)
        return cpu_kernels.decoder_layers(self._layer_structs(), hidden, step)


def attach_decoder_kernels(model: nn.Module) -> bool:
    """Give each Llama model in ``model`` whose layers can all take the C layer a
    :class:`DecoderLayersKernel`. Returns whether one was attached."""
    attached = False
    for module in model.modules():
        if isinstance(module, LlamaModel) and len(module.layers) and all(map(supports, module.layers)):
            layers = cast(Sequence[LlamaDecoderLayer], module.layers)
            module.decode_kernel = DecoderLayersKernel(layers, module.local_layers)
            attached = True
    return attached
