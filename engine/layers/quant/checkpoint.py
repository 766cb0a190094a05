"""Which quantization a model is served with, and the loader's side of quantized checkpoints.

``--quant auto`` follows the checkpoint: an AutoAWQ ``quantization_config`` (GEMM, 4 bits) means
``int4``, a BitNet architecture or ``quant_method: bitnet`` means ``bitnet``, anything else ``none``.
``int4``/``bitnet`` on a float checkpoint quantize it after loading (RTN g128 / absmean).
A GGUF file is ``none`` under ``auto``; with ``int4`` its Q4_0/Q4_1 linears stay packed.

While the loader streams tensors into the float model, :class:`QuantizedTensors` keeps the packed
ones aside (AWQ ``qweight``/``qzeros``/``scales`` and BitNet ``uint8`` weights and ``weight_scale``,
by their checkpoint names; a GGUF file's Q4_0/Q4_1/TQ1_0/TQ2_0 blocks, handed over by the loader with
their GGML type where the load plan keeps them: ``engine/loader/plan.py``);
:func:`apply_quantization` then swaps the matching ``nn.Linear`` modules for quantized ones.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.layers.quant.formats import (
    GGUF_TERNARY_TYPES,
    int4_from_awq_gemm,
    int4_from_gguf,
    ternary_from_bitnet,
    ternary_from_gguf,
)
from engine.layers.quant.swap import install_quantized_weights, quantize_linears
from engine.layers.quant.weights import Int4Weight, TernaryBlockWeight, TernaryWeight

QUANT_CHOICES: tuple[str, ...] = ("auto", "none", "int4", "bitnet")
DEFAULT_GROUP_SIZE = 128
_AWQ_SUFFIXES = (".qweight", ".qzeros", ".scales")
GGUF_INT4_TYPES = ("Q4_0", "Q4_1")
"""GGML types of the raw GGUF blocks a linear keeps packed under ``--quant int4``."""
_BITNET_SCALE = ".weight_scale"


def checkpoint_quant(path: Path) -> tuple[str, dict[str, Any]]:
    """(``none``/``int4``/``bitnet``, the ``quantization_config``) of a model directory or file."""
    if not path.is_dir():
        return "none", {}  # GGUF: its Q4/Q8 tensors are dequantized by the loader
    config = json.loads((path / "config.json").read_text())
    quant_config = config.get("quantization_config") or {}
    method = quant_config.get("quant_method")
    if method == "awq":
        bits = quant_config.get("bits", quant_config.get("w_bit", 4))
        version = str(quant_config.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm":
            raise ValueError(f"only 4-bit GEMM AutoAWQ checkpoints are supported, not {bits}-bit {version}")
        return "int4", quant_config
    if method == "bitnet" or "BitNetForCausalLM" in (config.get("architectures") or []):
        if quant_config.get("use_rms_norm"):
            raise ValueError("BitNet checkpoints with an RMSNorm inside BitLinear are not supported")
        return "bitnet", quant_config
    if method:
        raise ValueError(f"unsupported quantization_config quant_method {method!r}")
    return "none", quant_config


def resolve_quant(requested: str, detected: str) -> str:
    if requested not in QUANT_CHOICES:
        raise ValueError(f"quant must be one of {', '.join(QUANT_CHOICES)}, not {requested!r}")
    if requested == "auto":
        return detected
    if detected != "none" and requested != detected:
        raise ValueError(
            f"the checkpoint is {detected}-quantized; it cannot be served with quant={requested}"
        )
    return requested


class QuantizedTensors:
    """Takes a checkpoint's packed tensors out of the loader's stream, by module name."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        self.gguf_blocks: dict[str, tuple[torch.Tensor, str]] = {}
        """module -> (its raw GGUF blocks, their GGML type name), from :meth:`keep_gguf_blocks`."""

    def keep_gguf_blocks(self, module: str, blocks: torch.Tensor, ggml_type: str) -> None:
        """A GGUF linear's Q4_0/Q4_1 (TQ1_0/TQ2_0) blocks, which the load plan keeps packed."""
        if ggml_type not in (*GGUF_INT4_TYPES, *GGUF_TERNARY_TYPES):
            raise ValueError(f"{module}: GGUF {ggml_type} blocks cannot be kept packed")
        self.gguf_blocks[module] = (blocks, ggml_type)

    def held(self) -> bool:
        """Whether any packed weight was kept (else a quantizing method quantizes the float model)."""
        return bool(self.tensors or self.gguf_blocks)

    def _part(self, name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
        if self.method == "int4":
            suffixes: Iterable[str] = _AWQ_SUFFIXES
        elif self.method == "bitnet":
            if name.endswith(".weight") and tensor.dtype != torch.uint8:
                return None
            suffixes = (_BITNET_SCALE, ".weight")
        else:
            return None
        for suffix in suffixes:
            if name.endswith(suffix):
                return name.removesuffix(suffix), suffix
        return None

    def filter(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the float tensors; keep the packed ones."""
        for name, tensor in tensors:
            part = self._part(name, tensor)
            if part is None:
                yield name, tensor
            else:
                self.tensors.setdefault(part[0], {})[part[1]] = tensor

    def parameter_names(self) -> set[str]:
        """The float parameters the packed tensors stand in for (absent from the checkpoint)."""
        return {module + ".weight" for module in (*self.tensors, *self.gguf_blocks)}

    def weights(
        self, model: nn.Module, quant_config: Mapping[str, Any]
    ) -> Iterator[tuple[str, Int4Weight | TernaryWeight | TernaryBlockWeight]]:
        """(module, weight) one at a time: a ternary weight unpacked to one int8 a value exists for one
        module at a time, not for the whole model."""
        for module, (blocks, ggml_type) in self.gguf_blocks.items():
            shape = _linear_shape(model.get_submodule(module))
            if ggml_type in GGUF_TERNARY_TYPES:
                yield module, ternary_from_gguf(blocks, shape, ggml_type)
            else:
                yield module, int4_from_gguf(blocks, shape, ggml_type)
        for module, parts in self.tensors.items():
            shape = _linear_shape(model.get_submodule(module))
            if self.method == "int4":
                _check_parts(module, parts, _AWQ_SUFFIXES)
                yield module, _int4_weight(parts, shape, quant_config)
            else:
                _check_parts(module, parts, (".weight", _BITNET_SCALE))
                yield module, ternary_from_bitnet(parts[".weight"], parts[_BITNET_SCALE], shape[0])


def _int4_weight(
    parts: Mapping[str, torch.Tensor], shape: tuple[int, int], quant_config: Mapping[str, Any]
) -> Int4Weight:
    """One linear's AutoAWQ tensors (possibly padded past ``shape``)."""
    group_size = int(quant_config.get("group_size", quant_config.get("q_group_size", DEFAULT_GROUP_SIZE)))
    return int4_from_awq_gemm(parts[".qweight"], parts[".qzeros"], parts[".scales"], group_size, shape)


def _check_parts(module: str, parts: Mapping[str, torch.Tensor], needed: tuple[str, ...]) -> None:
    if set(parts) != set(needed):
        raise ValueError(f"{module}: packed tensors {sorted(parts)} are incomplete, need {needed}")


def apply_quantization(
    model: nn.Module,
    method: str,
    packed: QuantizedTensors,
    quant_config: Mapping[str, Any],
    group_size: int = DEFAULT_GROUP_SIZE,
    *,
    ternary_kernel: bool = False,
) -> None:
    """Swap in quantized linears: the checkpoint's packed weights, else quantize the float ones. With
    ``ternary_kernel``, a BitNet checkpoint's go to the ternary C kernel (``install_quantized_weights``)."""
    if method == "none":
        return
    if packed.held():
        install_quantized_weights(model, packed.weights(model, quant_config), ternary_kernel=ternary_kernel)
    else:
        quantize_linears(model, "int4" if method == "int4" else "bitnet", group_size=group_size)


def _linear_shape(linear: nn.Module) -> tuple[int, int]:
    """(out_features, in_features) of the linear a checkpoint's packed weight replaces."""
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"a packed weight for {type(linear).__name__}, which is not a linear layer")
    return linear.out_features, linear.in_features
