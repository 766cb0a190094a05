"""AWQ (Lin et al., 2023): activation-aware INT4 weight quantization, layer by layer.

AWQ protects the input channels that see large activations: it multiplies weight column ``j`` by
``s_j`` before round-to-nearest and divides the activation by ``s_j`` (folded into the preceding
norm or linear, so inference costs nothing extra). For each group of linears that read the same
input, ``s = mean|x|^alpha`` is searched over a grid of ``alpha`` (``alpha = 0`` is plain RTN),
minimising the error of the block those linears feed: the whole attention for q/k/v, the whole
MLP for gate/up. Each weight group is then clipped to the range that minimises its output error
(AutoAWQ's ``auto_clip``). Unlike AutoAWQ, each half-layer is quantized before the next one is
calibrated, so every linear is calibrated on the outputs of the quantized layers before it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch import nn

from engine.layers.quant.linear import Int4Linear
from engine.layers.quant.quantizers import pad_to_groups, rtn_fake_quantize

SCALE_GRID = 20
"""Values of ``alpha`` tried: 0, 1/20, ..., 19/20."""
CLIP_GRID = 20
CLIP_MAX_SHRINK = 0.5
"""The clip search shrinks each group's range by 0, 1/20, ... up to (not including) this fraction."""
SEARCH_SEQUENCES = 1
"""Calibration sequences the scale search measures its loss on (the statistics use all of them)."""
CLIP_TOKENS = 1024
"""At most this many calibration tokens (evenly spaced) feed the clip search."""


class _Attention(Protocol):
    """The attention of a Llama-style decoder layer, by Hugging Face's names (``engine.models.llama``
    has them; this layer of the engine may not import it, so AWQ names what it reads here)."""

    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...


class _Mlp(Protocol):
    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class _DecoderLayer(Protocol):
    self_attn: _Attention
    mlp: _Mlp
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module


class _Decoder(Protocol):
    embed_tokens: Callable[[torch.Tensor], torch.Tensor]
    rotary_emb: Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]]
    layers: Iterable[nn.Module]


@dataclass
class ScaleGroup:
    """Linears that read the same input, the op whose output that input is (to fold ``1/s`` into,
    None when there is none, as for o_proj under GQA), and the block whose output error the scale
    search minimises (the linears' own outputs if None)."""

    previous: nn.Module | None  # an RMSNorm (``weight`` scales its output) or an nn.Linear (its rows)
    linears: list[nn.Linear]
    block: Callable[[torch.Tensor], torch.Tensor] | None = None
    unclipped: tuple[nn.Linear, ...] = ()


def llama_scale_groups(layer: nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> list[list[ScaleGroup]]:
    """The AWQ groups of a Llama-style decoder layer with Hugging Face names: attention's, then the
    MLP's. The attention block runs on whole sequences of ``len(cos)`` tokens."""
    llama = cast(_DecoderLayer, layer)
    attn, mlp = llama.self_attn, llama.mlp

    def attention(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([attn(sequence, cos, sin) for sequence in x.split(cos.shape[0])])

    # q and k are not clipped: their error reaches the output only through softmax (as AutoAWQ).
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    # Without GQA, v's output rows feed o's input columns one to one; with GQA, several query heads
    # share each v row, and a shared scale was measured worse than none (docs/quantization.md).
    o_previous = attn.v_proj if attn.v_proj.out_features == attn.o_proj.in_features else None
    attention_groups = [
        ScaleGroup(llama.input_layernorm, qkv, attention, unclipped=(attn.q_proj, attn.k_proj)),
        ScaleGroup(o_previous, [attn.o_proj]),
    ]
    mlp_groups = [
        ScaleGroup(llama.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], mlp),
        ScaleGroup(mlp.up_proj, [mlp.down_proj]),
    ]
    return [attention_groups, mlp_groups]


@torch.no_grad()
def search_awq_scales(
    x: torch.Tensor,
    linears: list[nn.Linear],
    group_size: int,
    block: Callable[[torch.Tensor], torch.Tensor] | None = None,
    x_mean: torch.Tensor | None = None,
) -> torch.Tensor:
    """Best per-input-channel scale ``s`` for linears reading ``x [T, K]`` (AWQ's grid search).

    The loss is the mean squared error of ``block(x)`` (or of each linear's output when there is
    no block) when the linears' weights ``W`` are replaced by ``RTN(W * s) / s``. ``x_mean``
    (``mean|x|`` per channel) may come from more tokens than ``x``.
    """
    if x_mean is None:
        x_mean = x.abs().float().mean(dim=0)
    x_mean = x_mean.float().clamp(min=1e-6)
    originals = [linear.weight.detach().clone() for linear in linears]

    def outputs() -> list[torch.Tensor]:
        return [block(x)] if block is not None else [linear(x) for linear in linears]

    reference = outputs()
    best_scales, best_error = torch.ones_like(x_mean), float("inf")
    try:
        for step in range(SCALE_GRID):
            scales = x_mean.pow(step / SCALE_GRID)
            scales = scales / (scales.max() * scales.min()).sqrt()
            for linear, weight in zip(linears, originals, strict=True):
                s = scales.to(weight.dtype)
                linear.weight.copy_(rtn_fake_quantize(weight * s, group_size) / s)
            pairs = zip(outputs(), reference, strict=True)
            error = sum((out - ref).float().pow(2).mean().item() for out, ref in pairs)
            if error < best_error:
                best_scales, best_error = scales, error
    finally:
        for linear, weight in zip(linears, originals, strict=True):
            linear.weight.copy_(weight)
    return best_scales


@torch.no_grad()
def apply_awq_scales(group: ScaleGroup, scales: torch.Tensor) -> None:
    """Multiply the linears' input columns by ``scales`` and divide the previous op's output by them."""
    previous = group.previous
    if isinstance(previous, nn.Linear):
        previous.weight.div_(scales.to(previous.weight.dtype)[:, None])
        if previous.bias is not None:
            previous.bias.div_(scales.to(previous.bias.dtype))
    elif previous is not None:  # a norm: its weight scales its output
        weight = previous.get_parameter("weight")
        weight.div_(scales.to(weight.dtype))
    for linear in group.linears:
        linear.weight.mul_(scales.to(linear.weight.dtype)[None, :])


@torch.no_grad()
def clip_weight(linear: nn.Linear, x: torch.Tensor, group_size: int) -> None:
    """Shrink each weight group's range ``[min, max]`` (both ends by the same fraction) to the one
    that minimises the group's contribution to the output error on ``x [T, K]``, in place.

    A group's error is ``d^T H d``, with ``d`` its weight error and ``H`` the Gram matrix of its
    input columns: exact over all the tokens, and cheaper than comparing outputs token by token.
    """
    n, k = linear.weight.shape
    weight = pad_to_groups(linear.weight, group_size)  # [N, G, g]
    num_groups = weight.shape[1]
    step = max(1, x.shape[0] // CLIP_TOKENS)
    padded = x.new_zeros(len(x[::step]), num_groups * group_size, dtype=torch.float32)
    padded[:, :k] = x[::step].float()  # padding columns see no input
    columns = padded.view(-1, num_groups, group_size)
    gram = torch.einsum("tgk,tgl->gkl", columns, columns) / columns.shape[0]  # [G, g, g]
    hi = weight.amax(dim=-1, keepdim=True)
    lo = weight.amin(dim=-1, keepdim=True)
    best_error = torch.full((n, num_groups), float("inf"), device=weight.device)
    best_ratio = torch.ones_like(hi)
    for i in range(int(CLIP_GRID * CLIP_MAX_SHRINK)):
        ratio = 1 - i / CLIP_GRID
        clipped = torch.minimum(torch.maximum(weight, lo * ratio), hi * ratio)
        delta = rtn_fake_quantize(clipped.view(n, -1), group_size).view(weight.shape) - weight
        error = torch.einsum("ngk,gkl,ngl->ng", delta, gram, delta)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_ratio[better] = ratio
    clipped = torch.minimum(torch.maximum(weight, lo * best_ratio), hi * best_ratio)
    linear.weight.copy_(clipped.view(n, -1)[:, :k].to(linear.weight.dtype))


def _run_layer(layer: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``layer`` over each sequence of ``hidden [S, L, H]``."""
    return torch.stack([layer(sequence, cos, sin) for sequence in hidden])


class _InputsCaptured(Exception):
    """Raised by the capture hook once every wanted input is seen: the rest of the layer is skipped."""


def _capture_inputs(
    layer: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, linears: list[nn.Module]
) -> list[torch.Tensor]:
    """The inputs ``[S * L, K]`` of ``linears`` while ``layer`` runs over ``hidden``, stopping each
    sequence's forward pass as soon as they are all seen."""
    captured: dict[int, list[torch.Tensor]] = {id(linear): [] for linear in linears}
    waiting: set[int] = set()

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        captured[id(module)].append(args[0].detach())
        waiting.discard(id(module))
        if not waiting:
            raise _InputsCaptured

    handles = [linear.register_forward_pre_hook(hook) for linear in linears]
    try:
        for sequence in hidden:
            waiting.update(captured)
            try:
                layer(sequence, cos, sin)
            except _InputsCaptured:
                pass
    finally:
        for handle in handles:
            handle.remove()
    return [torch.cat(captured[id(linear)]) for linear in linears]


def _quantize(layer: nn.Module, linears: list[nn.Linear], group_size: int) -> None:
    names = {id(module): name for name, module in layer.named_modules()}
    for linear in linears:
        layer.set_submodule(names[id(linear)], Int4Linear.from_linear(linear, group_size))


@torch.no_grad()
def awq_quantize(
    model: nn.Module,
    calibration_ids: torch.Tensor,
    group_size: int = 128,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Replace every decoder-layer linear of a Llama-style model by an AWQ ``Int4Linear``, in place.

    ``calibration_ids [S, L]`` are ``S`` token sequences of ``L`` tokens. ``progress(done, total)``
    is called after each layer. The embedding, the norms and ``lm_head`` stay float.
    """
    decoder = cast(_Decoder, model.model)  # a Llama-style model: see _DecoderLayer
    hidden = decoder.embed_tokens(calibration_ids)
    cos, sin = decoder.rotary_emb(torch.arange(calibration_ids.shape[1], device=hidden.device), hidden.dtype)
    search_tokens = SEARCH_SEQUENCES * calibration_ids.shape[1]
    layers = list(decoder.layers)
    for index, layer in enumerate(layers):
        for groups in llama_scale_groups(layer, cos, sin):
            inputs = _capture_inputs(layer, hidden, cos, sin, [group.linears[0] for group in groups])
            for group, x in zip(groups, inputs, strict=True):
                if group.previous is not None:
                    scales = search_awq_scales(
                        x[:search_tokens], group.linears, group_size, group.block, x.abs().float().mean(dim=0)
                    )
                    apply_awq_scales(group, scales)
                    x = x / scales.to(x.dtype)
                for linear in group.linears:
                    if not any(linear is skipped for skipped in group.unclipped):
                        clip_weight(linear, x, group_size)
            _quantize(layer, [linear for group in groups for linear in group.linears], group_size)
        hidden = _run_layer(layer, hidden, cos, sin)
        if progress is not None:
            progress(index + 1, len(layers))
