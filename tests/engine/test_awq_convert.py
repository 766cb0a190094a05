"""Checkpoint layouts -> canonical weights, and the RTN / AWQ / absmean quantizers.

Each converter is checked against an independent producer of its format: AutoAWQ's packing loop
(transcribed below), gguf-py's Q4_0/Q4_1 quantizer and dequantizer, transformers' BitNet packer.
"""

import gguf
import numpy as np
import pytest
import torch
from torch import nn
from transformers.integrations.bitnet import pack_weights as hf_pack_bitnet

from engine.layers.quant.awq import ScaleGroup, apply_awq_scales, search_awq_scales
from engine.layers.quant.formats import (
    bitnet_packed_from_ternary,
    int4_from_awq_gemm,
    int4_from_gguf,
    ternary_from_bitnet,
)
from engine.layers.quant.quantizers import absmean_ternarize, rtn_quantize


def autoawq_pack(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ ``WQLinear_GEMM.from_linear``'s packing of ``[rows, cols]`` 4-bit ints, as written there."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    qweight = torch.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=torch.int32)
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + order_map[i]].to(torch.int32) << (i * 4)
    return qweight


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_gemm_tensors_convert_to_the_same_weights(group_size: int) -> None:
    gen = torch.Generator().manual_seed(group_size)
    k, n = 2 * group_size, 40  # AWQ's [in, out] orientation
    q = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 16, (k // group_size, n), generator=gen)
    scales = (torch.rand((k // group_size, n), generator=gen) * 0.02 + 0.001).half()
    per_row = (zeros.repeat_interleave(group_size, 0), scales.float().repeat_interleave(group_size, 0))
    expected = ((q - per_row[0]) * per_row[1]).t()

    weight = int4_from_awq_gemm(autoawq_pack(q), autoawq_pack(zeros), scales, group_size)

    assert weight.codes.shape == (n, k) and weight.group_size == group_size
    assert torch.equal(weight.codes, q.t().to(torch.uint8))
    torch.testing.assert_close(weight.dequantize(), expected, rtol=0, atol=1e-6)


def test_awq_rejects_inconsistent_tensors() -> None:
    q = autoawq_pack(torch.zeros(128, 16, dtype=torch.int32))
    zeros = autoawq_pack(torch.zeros(2, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="do not agree"):
        int4_from_awq_gemm(q, zeros, torch.ones(2, 16, dtype=torch.float16), 128)


@pytest.mark.parametrize("quant_type", ["Q4_0", "Q4_1"])
def test_gguf_blocks_convert_to_the_same_weights(quant_type: str) -> None:
    qtype = gguf.GGMLQuantizationType[quant_type]
    w = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(w, qtype)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))

    weight = int4_from_gguf(blocks, (24, 96), quant_type)

    assert weight.group_size == 32
    assert torch.equal(weight.dequantize(), expected)


def test_gguf_rejects_other_types() -> None:
    with pytest.raises(ValueError, match="Q4_0 or Q4_1"):
        int4_from_gguf(np.zeros((1, 34), np.uint8), (1, 32), "Q8_0")


def test_bitnet_packing_matches_transformers() -> None:
    ternary = torch.randint(-1, 2, (12, 20), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    hf_packed = hf_pack_bitnet(ternary.clone())
    weight = ternary_from_bitnet(hf_packed, torch.tensor([4.0]), out_features=12)
    assert torch.equal(weight.values, ternary) and weight.scale == 0.25
    packed, weight_scale = bitnet_packed_from_ternary(weight)
    assert torch.equal(packed, hf_packed) and weight_scale.item() == 4.0


def test_rtn_codes_are_in_range_and_error_is_bounded() -> None:
    w = torch.randn(16, 100, generator=torch.Generator().manual_seed(1))
    for group_size in (32, 64, 128):
        q = rtn_quantize(w, group_size)
        assert q.codes.shape == w.shape and int(q.codes.max()) <= 15
        step = q.scales.repeat_interleave(group_size, 1)[:, :100]
        # the range spans 0 and the zero point is an integer: no clamping, half a step of rounding
        assert torch.all((q.dequantize() - w).abs() <= step * 0.5 + 1e-6)


def test_absmean_ternarize() -> None:
    w = torch.tensor([[0.9, -0.1, 0.0, -2.0], [0.4, 0.6, -0.7, 0.2]])
    t = absmean_ternarize(w)
    assert t.scale == pytest.approx(w.abs().mean().item())  # 0.6125
    assert t.values.tolist() == [[1, 0, 0, -1], [1, 1, -1, 0]]


def test_awq_folding_keeps_the_float_function() -> None:
    torch.manual_seed(0)
    norm_weight = nn.Parameter(torch.rand(64) + 0.5)
    linears = [nn.Linear(64, 32, bias=False), nn.Linear(64, 16, bias=False)]
    norm = nn.Module()
    norm.weight = norm_weight
    x = torch.randn(10, 64)
    before = [lin(x * norm_weight) for lin in linears]
    with torch.no_grad():
        apply_awq_scales(ScaleGroup(norm, linears), torch.rand(64) + 0.5)
    after = [lin(x * norm.weight) for lin in linears]
    for b, a in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_awq_scales_beat_rtn_on_activation_outliers() -> None:
    """With a few input channels carrying large activations, AWQ's search must lower the error."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=gen)
    x[:, :4] *= 30  # salient channels
    linear = nn.Linear(128, 64, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(64, 128, generator=gen) * 0.05)
    reference = x @ linear.weight.t()

    rtn_error = (x @ rtn_quantize(linear.weight, 64).dequantize().t() - reference).pow(2).mean()
    scales = search_awq_scales(x, [linear], 64)
    awq_weight = rtn_quantize(linear.weight * scales, 64).dequantize() / scales
    awq_error = (x @ awq_weight.t() - reference).pow(2).mean()

    assert awq_error < 0.8 * rtn_error
