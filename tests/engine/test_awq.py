"""AWQ pieces on small shapes: fake quantization, scale folding, clipping, the layer-by-layer loop."""

import copy

import pytest
import torch
from torch import nn

from engine.layers.quant import Int4Linear
from engine.layers.quant.awq import apply_awq_scales, awq_quantize, clip_weight, llama_scale_groups
from engine.layers.quant.quantizers import rtn_fake_quantize, rtn_quantize
from engine.layers.quant.swap import quantize_linears
from tests.engine.tiny_engine import make_tiny_model


def test_rtn_fake_quantize_is_rtn_dequantized() -> None:
    w = torch.randn(24, 100, generator=torch.Generator().manual_seed(0))
    for group_size in (32, 64, 128):  # 100 is ragged for all three
        torch.testing.assert_close(rtn_fake_quantize(w, group_size), rtn_quantize(w, group_size).dequantize())


@pytest.mark.parametrize("num_kv_heads", [2, 4])  # GQA (o_proj has no previous op) and MHA (v -> o)
@torch.no_grad()
def test_scale_folding_keeps_the_layer_function(num_kv_heads: int) -> None:
    model, config = make_tiny_model(seed=1, num_key_value_heads=num_kv_heads)
    layer = model.model.layers[0]
    x = torch.randn(12, config.hidden_size, generator=torch.Generator().manual_seed(2))
    cos, sin = model.model.rotary_emb(torch.arange(12), torch.float32)
    before = layer(x, cos, sin)
    folded = 0
    for phase in llama_scale_groups(layer, cos, sin):
        for group in phase:
            if group.previous is not None:
                width = group.linears[0].in_features
                scales = torch.rand(width, generator=torch.Generator().manual_seed(width)) + 0.5
                apply_awq_scales(group, scales)
                folded += 1
    assert folded == (4 if num_kv_heads == config.num_attention_heads else 3)
    torch.testing.assert_close(layer(x, cos, sin), before, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_clipping_lowers_the_output_error_of_heavy_tailed_weights() -> None:
    gen = torch.Generator().manual_seed(3)
    linear = nn.Linear(64, 16, bias=False)
    normal, divisor = torch.randn(2, 16, 64, generator=gen)
    heavy_tailed = normal / divisor.abs().clamp(min=0.05).sqrt()
    linear.weight.copy_(0.02 * heavy_tailed)
    x = torch.randn(256, 64, generator=gen)
    reference = x @ linear.weight.t()

    def error(weight: torch.Tensor) -> float:
        return (x @ rtn_fake_quantize(weight, 32).t() - reference).pow(2).mean().item()

    unclipped = error(linear.weight)
    clip_weight(linear, x, 32)
    assert error(linear.weight) < 0.99 * unclipped


@torch.no_grad()
def test_awq_quantizes_every_decoder_linear_and_beats_rtn_on_activation_outliers() -> None:
    model, config = make_tiny_model(seed=4)
    model.model.embed_tokens.weight[:, :3] *= 20  # a few salient hidden channels, as real LLMs have
    ids = torch.randint(0, config.vocab_size, (3, 32), generator=torch.Generator().manual_seed(5))
    eval_ids = torch.randint(0, config.vocab_size, (48,), generator=torch.Generator().manual_seed(6))
    reference = model.compute_logits(model(eval_ids, torch.arange(48)))

    rtn = copy.deepcopy(model)
    quantize_linears(rtn, "int4", group_size=32)
    awq = copy.deepcopy(model)
    awq_quantize(awq, ids, group_size=32)

    linears = [m for m in awq.model.modules() if isinstance(m, Int4Linear)]
    assert len(linears) == 7 * config.num_hidden_layers
    assert not any(type(m) is nn.Linear for m in awq.model.modules())

    def error(quantized: nn.Module) -> float:
        logits = quantized.compute_logits(quantized(eval_ids, torch.arange(48)))
        return (logits - reference).pow(2).mean().item()

    assert error(awq) < error(rtn)
