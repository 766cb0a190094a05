"""Quantizers for experiments: RTN and AWQ (INT4, group-wise) and absmean (BitNet ternary).

AWQ (Lin et al., 2023) protects the input channels that see large activations: it scales weight
column ``j`` by ``s_j = mean|x_j| ** alpha`` before round-to-nearest and divides the activation by
``s_j`` (folded into the preceding norm or linear, so inference costs nothing extra). ``alpha`` is
searched per group of linears that share an input, minimising the group's output error on
calibration activations. Then, as AutoAWQ's ``auto_clip``, each group of weights is clipped to
the fraction of its range that minimises the output error (outliers otherwise stretch the grid).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.quant.weights import Int4Weight, TernaryWeight

INT4_MAX_CODE = 15
AWQ_GRID = 20
CLIP_GRID = 20
CLIP_MIN_RATIO = 0.5
CLIP_TOKENS = 256
NO_CLIP_SUFFIXES = ("q_proj", "k_proj")  # their error shows only through softmax (AutoAWQ skips them)


def rtn_quantize(weight: torch.Tensor, group_size: int) -> Int4Weight:
    """Round-to-nearest, asymmetric, with an integer zero point per group (AutoAWQ's formula)."""
    n, k = weight.shape
    num_groups = -(-k // group_size)
    w = weight.detach().float()
    if k % group_size:  # pad the last group with copies of its first column: no range change
        pad = w[:, (num_groups - 1) * group_size : (num_groups - 1) * group_size + 1]
        w = torch.cat([w, pad.expand(n, num_groups * group_size - k)], dim=1)
    groups = w.reshape(n, num_groups, group_size)
    # The range always spans 0 (as in GPTQ), so the integer zero point never needs clamping.
    lo = groups.amin(dim=-1).clamp(max=0)
    hi = groups.amax(dim=-1).clamp(min=0)
    scales = (hi - lo).clamp(min=1e-5) / INT4_MAX_CODE
    zeros = (-torch.round(lo / scales)).clamp(0, INT4_MAX_CODE)
    codes = (torch.round(groups / scales[..., None]) + zeros[..., None]).clamp(0, INT4_MAX_CODE)
    return Int4Weight(
        codes=codes.reshape(n, -1)[:, :k].to(torch.uint8).contiguous(),
        scales=scales,
        mins=-zeros * scales,
        group_size=group_size,
    )


def absmean_ternarize(weight: torch.Tensor) -> TernaryWeight:
    """BitNet b1.58's weight quantizer: ``round(W / mean|W|)`` clipped to {-1, 0, 1}."""
    w = weight.detach().float()
    scale = w.abs().mean().clamp(min=1e-5)
    return TernaryWeight(values=(w / scale).round().clamp(-1, 1).to(torch.int8), scale=float(scale))


# -- AWQ ----------------------------------------------------------------------------------------


@dataclass
class ScaleGroup:
    """Linears that read the same input, and the op whose output that input is (to fold 1/s into)."""

    previous: nn.Module  # an RMSNorm (``weight`` scales its output) or an nn.Linear (rows scale it)
    linears: list[nn.Linear]


def llama_scale_groups(decoder_layer: nn.Module) -> list[ScaleGroup]:
    """The AWQ groups of a Llama-style decoder layer with Hugging Face module names."""
    attn, mlp = decoder_layer.self_attn, decoder_layer.mlp
    groups = [
        ScaleGroup(decoder_layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj]),
        ScaleGroup(decoder_layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj]),
        ScaleGroup(mlp.up_proj, [mlp.down_proj]),
    ]
    if attn.v_proj.out_features == attn.o_proj.in_features:  # without GQA, v's rows feed o directly
        groups.append(ScaleGroup(attn.v_proj, [attn.o_proj]))
    return groups


def _fake_quantize(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    return rtn_quantize(weight, group_size).dequantize()


@torch.no_grad()
def search_awq_scales(x: torch.Tensor, linears: list[nn.Linear], group_size: int) -> torch.Tensor:
    """Best per-input-channel scale ``s`` for linears reading ``x [T, K]`` (AWQ's grid search)."""
    x = x.float()
    weights = [lin.weight.float() for lin in linears]
    reference = [x @ w.t() for w in weights]
    x_mean = x.abs().mean(dim=0).clamp(min=1e-6)
    best_scales, best_error = torch.ones_like(x_mean), float("inf")
    for step in range(AWQ_GRID):
        alpha = step / AWQ_GRID
        scales = x_mean.pow(alpha)
        scales = scales / (scales.max() * scales.min()).sqrt()
        error = 0.0
        for w, ref in zip(weights, reference, strict=True):
            quantized = _fake_quantize(w * scales, group_size) / scales
            error += (x @ quantized.t() - ref).pow(2).mean().item()
        if error < best_error:
            best_scales, best_error = scales, error
    return best_scales


@torch.no_grad()
def apply_awq_scales(group: ScaleGroup, scales: torch.Tensor) -> None:
    """Multiply the linears' input columns by ``scales`` and divide the previous op's output by them."""
    previous = group.previous
    if isinstance(previous, nn.Linear):
        previous.weight.div_(scales.to(previous.weight.dtype)[:, None])
        if previous.bias is not None:
            previous.bias.div_(scales.to(previous.bias.dtype))
    else:
        previous.weight.div_(scales.to(previous.weight.dtype))
    for linear in group.linears:
        linear.weight.mul_(scales.to(linear.weight.dtype)[None, :])


@torch.no_grad()
def awq_scale_model(
    decoder_layers: list[nn.Module],
    run_calibration: Callable[[], object],
    group_size: int,
    max_tokens: int = 512,
    scale_groups: Callable[[nn.Module], list[ScaleGroup]] = llama_scale_groups,
) -> None:
    """Search and fold AWQ scales into every decoder layer, in place; quantize afterwards (RTN).

    ``run_calibration`` runs the float model on calibration text; the inputs of each group's linears
    are captured with hooks in that one pass (not layer by layer on already-quantized outputs, as
    AutoAWQ does: simpler, and the scaled float model computes the same function either way).
    """
    groups = [group for layer in decoder_layers for group in scale_groups(layer)]
    captured: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(groups))}

    def capture(index: int) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            seen = sum(t.shape[0] for t in captured[index])
            if seen < max_tokens:
                captured[index].append(args[0].detach().reshape(-1, args[0].shape[-1])[: max_tokens - seen])

        return hook

    names = {id(module): name for layer in decoder_layers for name, module in layer.named_modules()}
    handles = [g.linears[0].register_forward_pre_hook(capture(i)) for i, g in enumerate(groups)]
    try:
        run_calibration()
    finally:
        for handle in handles:
            handle.remove()
    for i, group in enumerate(groups):
        if not captured[i]:
            raise RuntimeError("calibration did not reach every decoder layer")
        x = torch.cat(captured[i])
        scales = search_awq_scales(x, group.linears, group_size)
        apply_awq_scales(group, scales)
        for linear in group.linears:
            if not names[id(linear)].endswith(NO_CLIP_SUFFIXES):
                clip_weight(linear, x / scales.to(x.dtype), group_size)


@torch.no_grad()
def clip_weight(linear: nn.Linear, x: torch.Tensor, group_size: int) -> None:
    """Clip each weight group to ``+-ratio * max|w|`` with the ratio that minimises that group's
    contribution to the output error on ``x [T, K]`` (AutoAWQ's ``auto_clip``), in place."""
    w = linear.weight.float()
    n, k = w.shape
    if k % group_size:
        return  # ragged last group: leave unclipped
    step = max(1, x.shape[0] // CLIP_TOKENS)
    xg = x[::step].float().reshape(-1, k // group_size, group_size)  # [T, G, g]
    wg = w.reshape(n, k // group_size, group_size)  # [N, G, g]
    reference = torch.einsum("tgk,ngk->tng", xg, wg)
    max_abs = wg.abs().amax(dim=-1, keepdim=True)
    best_error = torch.full((n, k // group_size), float("inf"))
    best_max = max_abs.clone()
    for i in range(int(CLIP_GRID * (1 - CLIP_MIN_RATIO))):
        limit = max_abs * (1 - i / CLIP_GRID)
        clipped = torch.maximum(torch.minimum(wg, limit), -limit)
        quantized = _fake_quantize(clipped.reshape(n, k), group_size).reshape(wg.shape)
        error = (torch.einsum("tgk,ngk->tng", xg, quantized) - reference).pow(2).mean(dim=0)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_max = torch.where(better[..., None], limit, best_max)
    clipped = torch.maximum(torch.minimum(wg, best_max), -best_max).reshape(n, k)
    linear.weight.copy_(clipped.to(linear.weight.dtype))
