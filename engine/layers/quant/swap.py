"""Swap a loaded model's ``nn.Linear`` modules for quantized ones, in place (as gpt-fast does)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

from torch import nn

from engine.layers.quant.linear import Backend, Int4Linear, TernaryLinear
from engine.layers.quant.weights import Int4Weight, TernaryBlockWeight, TernaryWeight

QuantizedWeight = Int4Weight | TernaryWeight | TernaryBlockWeight

QuantMethod = Literal["int4", "bitnet"]
DEFAULT_SKIP = ("lm_head",)  # the output head stays in float: it is tied to the embedding in many models


def _skipped(name: str, skip: Iterable[str]) -> bool:
    return any(name == s or name.endswith("." + s) for s in skip)


def quantize_linears(
    model: nn.Module,
    method: QuantMethod,
    *,
    group_size: int = 128,
    skip: Iterable[str] = DEFAULT_SKIP,
    backend: Backend | None = None,
) -> list[str]:
    """Quantize every float ``nn.Linear`` not in ``skip`` (RTN for int4, absmean for bitnet).

    Returns the names of the replaced modules.
    """
    replaced = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or _skipped(name, skip):
            continue
        if method == "int4":
            new: nn.Module = Int4Linear.from_linear(module, group_size, backend=backend)
        else:
            new = TernaryLinear.from_linear(module, backend=backend)
        model.set_submodule(name, new)
        replaced.append(name)
    return replaced


def install_quantized_weights(
    model: nn.Module,
    weights: Mapping[str, QuantizedWeight] | Iterable[tuple[str, QuantizedWeight]],
    *,
    backend: Backend | None = None,
    ternary_kernel: bool = False,
) -> None:
    """Replace the linears named in ``weights`` (module names, e.g. ``model.layers.0.mlp.up_proj``)
    by quantized ones holding those checkpoint weights; biases and dtype come from the old module.
    GGUF ternary blocks go to the ternary C kernel's ``TernaryCpuLinear`` as they are (CPU only), and
    so do BitNet ternary weights with ``ternary_kernel`` (instead of ``TernaryLinear``)."""
    from engine.layers.ternary_linear import TernaryCpuLinear  # imports the CPU kernels' wrappers

    for name, weight in weights.items() if isinstance(weights, Mapping) else weights:
        old = model.get_submodule(name)
        if not isinstance(old, nn.Linear):
            raise TypeError(f"{name} is a {type(old).__name__}, not an nn.Linear")
        if (weight.out_features, weight.in_features) != (old.out_features, old.in_features):
            raise ValueError(
                f"{name}: checkpoint weight is {weight.out_features}x{weight.in_features}, "
                f"the model expects {old.out_features}x{old.in_features}"
            )
        bias = None if old.bias is None else old.bias.detach()
        if isinstance(weight, TernaryBlockWeight):
            codes, scales = weight.codes, weight.block_scales
            model.set_submodule(
                name, TernaryCpuLinear(codes, weight.in_features, block_scales=scales, bias=bias)
            )
            continue
        if isinstance(weight, TernaryWeight) and ternary_kernel:
            model.set_submodule(name, TernaryCpuLinear.from_ternary(weight, bias))
            continue
        dtype = old.weight.dtype
        device = None if old.weight.device.type == "meta" else old.weight.device
        new: nn.Module
        if isinstance(weight, Int4Weight):
            new = Int4Linear(weight, old.bias, device=device, dtype=dtype, backend=backend)
        else:
            new = TernaryLinear(weight, old.bias, device=device, dtype=dtype, backend=backend)
        model.set_submodule(name, new)
