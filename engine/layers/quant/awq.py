"""AWQ (Lin et al., 2023): activation-aware INT4 weight quantization, layer by layer, as AutoAWQ.

AWQ protects the input channels that see large activations: it multiplies weight column ``j`` by
``s_j`` before round-to-nearest and divides the activation by ``s_j`` (folded into the preceding
norm or linear, so inference costs nothing extra). For each group of linears that read the same
input, ``s = mean|x|^alpha / mean|w|^(1-alpha)`` is searched over a grid of ``alpha``, minimising the
error of the block those linears feed (the whole attention for q/k/v, the whole MLP for gate/up).
Then each weight group is clipped to the range that minimises its output error (AutoAWQ's
``auto_clip``), and the layer is quantized before the next layer is calibrated, so every layer sees
the outputs of the already-quantized layers before it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.quant.linear import Int4Linear
from engine.layers.quant.quantizers import pad_to_groups, rtn_fake_quantize

AWQ_GRID = 20
CLIP_GRID = 20
CLIP_MAX_SHRINK = 0.5
SEARCH_SEQS = 1  # calibration sequences the scale search measures its loss on (statistics use all)
CLIP_TOKENS = 512
NO_CLIP_SUFFIXES = ("q_proj", "k_proj")  # their error shows only through softmax (AutoAWQ skips them)
DUO_SCALING = True
SEQUENTIAL = True
CLIP_MODE = "symmetric"  # or "proportional"
TIE_GQA = True


@dataclass
class ScaleGroup:
    """Linears that read the same input, the op whose output that input is (to fold ``1/s`` into),
    and the block whose output the scale search compares (the linears themselves if None)."""

    previous: nn.Module | None  # an RMSNorm (``weight`` scales its output), an nn.Linear (rows scale it)
    linears: list[nn.Linear]
    block: Callable[[torch.Tensor], torch.Tensor] | None = None
    num_kv_heads: int = 0
    """Set for ``v_proj -> o_proj`` with GQA: o's input channel ``(head, d)`` is v's output channel
    ``(head // heads_per_kv, d)``, so the query heads that share a KV head share their scales."""

    def tie(self, per_channel: torch.Tensor) -> torch.Tensor:
        """``[K]`` values made equal across the channels that must share a scale (their mean)."""
        if not self.num_kv_heads or self.previous is None:
            return per_channel
        heads = per_channel.view(self.num_kv_heads, -1, self.previous.weight.shape[0] // self.num_kv_heads)
        return heads.mean(dim=1, keepdim=True).expand_as(heads).reshape(-1)

    def previous_scales(self, scales: torch.Tensor) -> torch.Tensor:
        """The linears' input scales as scales of the previous op's outputs."""
        if not self.num_kv_heads or self.previous is None:
            return scales
        head_dim = self.previous.weight.shape[0] // self.num_kv_heads
        return scales.view(self.num_kv_heads, -1, head_dim)[:, 0].reshape(-1)


def llama_scale_groups(layer: nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> list[list[ScaleGroup]]:
    """The AWQ groups of a Llama-style decoder layer: attention's, then the MLP's."""
    attn, mlp = layer.self_attn, layer.mlp

    def attention(x: torch.Tensor) -> torch.Tensor:  # x holds whole sequences of len(cos) tokens
        return torch.cat([attn(seq, cos, sin) for seq in x.split(cos.shape[0])])

    attention_groups = [ScaleGroup(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], attention)]
    if attn.v_proj.out_features == attn.o_proj.in_features:  # without GQA, v's rows feed o directly
        attention_groups.append(ScaleGroup(attn.v_proj, [attn.o_proj]))
    elif TIE_GQA:
        attention_groups.append(ScaleGroup(attn.v_proj, [attn.o_proj], num_kv_heads=attn.num_kv_heads))
    else:
        attention_groups.append(ScaleGroup(None, [attn.o_proj]))
    mlp_groups = [
        ScaleGroup(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], mlp),
        ScaleGroup(mlp.up_proj, [mlp.down_proj]),
    ]
    return [attention_groups, mlp_groups]


def _group_mean_abs(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per input channel, the mean of ``|w|`` relative to its quantization group's max (AutoAWQ)."""
    n, k = weight.shape
    w = pad_to_groups(weight, group_size).abs()
    return (w / (w.amax(dim=-1, keepdim=True) + 1e-6)).view(n, -1)[:, :k].mean(dim=0)


@torch.no_grad()
def search_awq_scales(
    x: torch.Tensor,
    linears: list[nn.Linear],
    group_size: int,
    block: Callable[[torch.Tensor], torch.Tensor] | None = None,
    x_mean: torch.Tensor | None = None,
    tie: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Best per-input-channel scale ``s`` for linears reading ``x [T, K]`` (AWQ's grid search).

    The loss is the mean squared error of ``block(x)`` (or of each linear's output when there is
    no block) with the linears' weights replaced by their scaled, quantized, unscaled versions.
    ``x_mean`` (``mean|x|`` per channel) may come from more tokens than ``x``.
    """
    if x_mean is None:
        x_mean = x.abs().float().mean(dim=0)
    x_mean = x_mean.float().clamp(min=1e-6)
    originals = [lin.weight.detach().clone() for lin in linears]
    w_mean = _group_mean_abs(torch.cat([w.float() for w in originals]), group_size).clamp(min=1e-6)
    if tie is not None:
        x_mean, w_mean = tie(x_mean), tie(w_mean)

    def run() -> torch.Tensor | list[torch.Tensor]:
        return block(x) if block is not None else [lin(x) for lin in linears]

    reference = run()
    best_scales, best_error = torch.ones_like(x_mean), float("inf")
    try:
        for step in range(AWQ_GRID):
            alpha = step / AWQ_GRID
            scales = x_mean.pow(alpha)
            if DUO_SCALING:
                scales = scales / w_mean.pow(1 - alpha)
            scales = scales / (scales.max() * scales.min()).sqrt()
            for lin, w in zip(linears, originals, strict=True):
                s = scales.to(w.dtype)
                lin.weight.copy_(rtn_fake_quantize(w * s, group_size) / s)
            out = run()
            if isinstance(out, list):
                error = sum((o - r).float().pow(2).mean().item() for o, r in zip(out, reference, strict=True))
            else:
                error = (out - reference).float().pow(2).mean().item()
            if error < best_error:
                best_scales, best_error = scales, error
    finally:
        for lin, w in zip(linears, originals, strict=True):
            lin.weight.copy_(w)
    return best_scales


@torch.no_grad()
def apply_awq_scales(group: ScaleGroup, scales: torch.Tensor) -> None:
    """Multiply the linears' input columns by ``scales`` and divide the previous op's output by them."""
    previous, previous_scales = group.previous, group.previous_scales(scales)
    if isinstance(previous, nn.Linear):
        previous.weight.div_(previous_scales.to(previous.weight.dtype)[:, None])
        if previous.bias is not None:
            previous.bias.div_(previous_scales.to(previous.bias.dtype))
    elif previous is not None:
        previous.weight.div_(previous_scales.to(previous.weight.dtype))
    for linear in group.linears:
        linear.weight.mul_(scales.to(linear.weight.dtype)[None, :])


@torch.no_grad()
def clip_weight(linear: nn.Linear, x: torch.Tensor, group_size: int) -> None:
    """Clip each weight group to the range that minimises that group's contribution to the output
    error on ``x [T, K]`` (AutoAWQ's ``auto_clip``), in place.

    A group's error is ``d^T H d`` with ``d`` its weight error and ``H`` the Gram matrix of its
    input columns: exact over all tokens, and cheaper than comparing outputs token by token.
    """
    n, k = linear.weight.shape
    wg = pad_to_groups(linear.weight, group_size)  # [N, G, g]
    num_groups = wg.shape[1]
    xp = x.new_zeros(x.shape[0], num_groups * group_size, dtype=torch.float32)  # padding sees no input
    xp[:, :k] = x.float()
    xg = xp.view(-1, num_groups, group_size)
    hessian = torch.einsum("tgk,tgl->gkl", xg, xg) / xg.shape[0]  # [G, g, g]
    hi = wg.amax(dim=-1, keepdim=True)
    lo = wg.amin(dim=-1, keepdim=True)
    if CLIP_MODE == "symmetric":
        hi = torch.maximum(hi, -lo)
        lo = -hi
    best_error = torch.full((n, num_groups), float("inf"), device=wg.device)
    best_hi, best_lo = hi.clone(), lo.clone()
    for i in range(int(CLIP_GRID * CLIP_MAX_SHRINK)):
        ratio = 1 - i / CLIP_GRID
        clipped = torch.minimum(torch.maximum(wg, lo * ratio), hi * ratio)
        delta = rtn_fake_quantize(clipped.reshape(n, -1), group_size).view(wg.shape) - wg
        error = torch.einsum("ngk,gkl,ngl->ng", delta, hessian, delta)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_hi = torch.where(better[..., None], hi * ratio, best_hi)
        best_lo = torch.where(better[..., None], lo * ratio, best_lo)
    clipped = torch.minimum(torch.maximum(wg, best_lo), best_hi).reshape(n, -1)[:, :k]
    linear.weight.copy_(clipped.to(linear.weight.dtype))


def _run_layer(layer: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``layer`` over each sequence of ``hidden [S, L, H]``."""
    return torch.stack([layer(seq, cos, sin) for seq in hidden])


def _capture_inputs(
    layer: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, linears: list[nn.Module]
) -> list[torch.Tensor]:
    """The inputs ``[S * L, K]`` of ``linears`` during ``layer(hidden)``."""
    captured: dict[int, list[torch.Tensor]] = {id(lin): [] for lin in linears}

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        captured[id(module)].append(args[0].detach())

    handles = [lin.register_forward_pre_hook(hook) for lin in linears]
    try:
        _run_layer(layer, hidden, cos, sin)
    finally:
        for handle in handles:
            handle.remove()
    return [torch.cat(captured[id(lin)]) for lin in linears]


def _quantize_linears(layer: nn.Module, linears: list[nn.Linear], group_size: int) -> None:
    names = {id(m): name for name, m in layer.named_modules()}
    for lin in linears:
        layer.set_submodule(names[id(lin)], Int4Linear.from_linear(lin, group_size))


@torch.no_grad()
def awq_quantize(
    model: nn.Module,
    calibration_ids: torch.Tensor,
    group_size: int = 128,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Quantize every decoder layer's linears of a Llama-style model to INT4 with AWQ, in place.

    ``calibration_ids [S, L]`` are ``S`` sequences of ``L`` tokens; the scale search measures its
    loss on the first ``SEARCH_SEQS`` of them. Linears outside the decoder layers (``lm_head``)
    stay float.
    """
    decoder = model.model
    hidden = decoder.embed_tokens(calibration_ids)
    seq_len = calibration_ids.shape[1]
    cos, sin = decoder.rotary_emb(torch.arange(seq_len, device=hidden.device), hidden.dtype)
    search_tokens = SEARCH_SEQS * seq_len
    layers = list(decoder.layers)
    for index, layer in enumerate(layers):
        float_next = None if SEQUENTIAL else _run_layer(layer, hidden, cos, sin)
        phases = llama_scale_groups(layer, cos, sin)
        for groups in phases:
            inputs = _capture_inputs(layer, hidden, cos, sin, [g.linears[0] for g in groups])
            for group, x in zip(groups, inputs, strict=True):
                if group.previous is not None:
                    x_mean = x.abs().float().mean(dim=0)
                    scales = search_awq_scales(
                        x[:search_tokens], group.linears, group_size, group.block, x_mean, group.tie
                    )
                    apply_awq_scales(group, scales)
                    x = x / scales.to(x.dtype)
                for lin in group.linears:
                    if not any(lin is getattr(layer.self_attn, s) for s in NO_CLIP_SUFFIXES):
                        clip_weight(lin, x, group_size)
            if SEQUENTIAL:
                _quantize_linears(layer, [lin for g in groups for lin in g.linears], group_size)
        if not SEQUENTIAL:
            _quantize_linears(layer, [lin for gs in phases for g in gs for lin in g.linears], group_size)
        hidden = _run_layer(layer, hidden, cos, sin) if float_next is None else float_next
        if progress is not None:
            progress(index + 1, len(layers))
