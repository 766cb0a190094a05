"""Which quantization a model is served with, and the loader's side of quantized checkpoints.

``--quant auto`` follows the checkpoint: an AutoAWQ ``quantization_config`` (GEMM, 4 bits) means
``int4``, a BitNet architecture or ``quant_method: bitnet`` means ``bitnet``, anything else ``none``.
``int4``/``bitnet`` on a float checkpoint quantize it after loading (RTN g128 / absmean).
A GGUF file is ``none`` under ``auto``; with ``int4`` its Q4_0/Q4_1 linears stay packed.

While the loader streams tensors into the float model, :class:`QuantizedTensors` keeps the packed
ones (AWQ ``qweight``/``qzeros``/``scales``; raw GGUF Q4 blocks, named ``<module>.gguf_q4_0`` or
``.gguf_q4_1`` by the GGUF reader; BitNet ``uint8`` weights and ``weight_scale``) aside;
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
GGUF_INT4_SUFFIXES = {".gguf_q4_0": "Q4_0", ".gguf_q4_1": "Q4_1"}
"""Raw GGUF blocks of a linear kept packed under ``--quant int4``: name suffix -> GGML type."""
GGUF_TERNARY_SUFFIXES = {".gguf_tq1_0": "TQ1_0", ".gguf_tq2_0": "TQ2_0"}
"""Raw GGUF ternary blocks kept packed with the Q4 ones (on CPU, for the ternary C kernel)."""
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

    def _part(self, name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
        if self.method == "int4":
            suffixes: Iterable[str] = (*_AWQ_SUFFIXES, *GGUF_INT4_SUFFIXES, *GGUF_TERNARY_SUFFIXES)
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
        return {module + ".weight" for module in self.tensors}

    def weights(
        self, model: nn.Module, quant_config: Mapping[str, Any]
    ) -> Iterator[tuple[str, Int4Weight | TernaryWeight | TernaryBlockWeight]]:
        """(module, weight) one at a time: a ternary weight unpacked to one int8 a value exists for one
        module at a time, not for the whole model."""
        for module, parts in self.tensors.items():
            shape = _linear_shape(model.get_submodule(module))
            if self.method == "int4" and parts.keys() & GGUF_TERNARY_SUFFIXES.keys():
                suffix = next(s for s in parts if s in GGUF_TERNARY_SUFFIXES)
                _check_parts(module, parts, (suffix,))
                yield module, ternary_from_gguf(parts[suffix], shape, GGUF_TERNARY_SUFFIXES[suffix])
            elif self.method == "int4":
                yield module, _int4_weight(module, parts, shape, quant_config)
            else:
                _check_parts(module, parts, (".weight", _BITNET_SCALE))
                yield module, ternary_from_bitnet(parts[".weight"], parts[_BITNET_SCALE], shape[0])


def _int4_weight(
    module: str, parts: Mapping[str, torch.Tensor], shape: tuple[int, int], quant_config: Mapping[str, Any]
) -> Int4Weight:
    """One linear's raw GGUF Q4 blocks, or its AutoAWQ tensors (possibly padded past ``shape``)."""
    if len(parts) == 1 and next(iter(parts)) in GGUF_INT4_SUFFIXES:
        suffix, blocks = next(iter(parts.items()))
        return int4_from_gguf(blocks, shape, GGUF_INT4_SUFFIXES[suffix])
    _check_parts(module, parts, _AWQ_SUFFIXES)
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
    if packed.tensors:
        install_quantized_weights(model, packed.weights(model, quant_config), ternary_kernel=ternary_kernel)
    else:
        quantize_linears(model, "int4" if method == "int4" else "bitnet", group_size=group_size)


def _linear_shape(linear: nn.Module) -> tuple[int, int]:
    """(out_features, in_features) of the linear a checkpoint's packed weight replaces."""
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"a packed weight for {type(linear).__name__}, which is not a linear layer")
    return linear.out_features, linear.in_features
