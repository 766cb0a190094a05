"""Int4Linear / TernaryLinear on both backends (Triton, interpreted without a GPU; torch CPU kernels)
against the dense matmul of the weights they stand for, and the nn.Linear swap."""

import pytest
import torch
from torch import nn

from engine.kernels.ternary_matmul import quantize_activations_ref
from engine.layers.quant import Int4Linear, TernaryLinear
from engine.layers.quant.quantizers import absmean_ternarize, rtn_quantize
from engine.layers.quant.swap import install_quantized_weights, quantize_linears

BACKENDS = ["torch", "triton"] if not torch.cuda.is_available() else ["triton"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_linear(k: int, n: int, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n).to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("batch", [1, 3, 16])
def test_int4_linear_computes_with_its_quantized_weight(backend: str, group_size: int, batch: int) -> None:
    k, n = group_size + 40, 37
    linear = make_linear(k, n, seed=batch)
    layer = Int4Linear.from_linear(linear, group_size, backend=backend)
    # the layer keeps scales and mins in fp16
    q = rtn_quantize(linear.weight, group_size)
    w = q.codes.float() * q.scales.half().float().repeat_interleave(group_size, 1)[:, :k]
    w += q.mins.half().float().repeat_interleave(group_size, 1)[:, :k]
    x = torch.randn(2, batch, k, device=DEVICE)

    out = layer(x)

    assert out.shape == (2, batch, n)
    torch.testing.assert_close(out, x @ w.t() + linear.bias, rtol=1e-4, atol=1e-4)
    # and it is close to the float layer it replaces
    assert (out - linear(x)).abs().max() < 0.1 * linear(x).abs().max()


def test_int4_linear_takes_unpadded_codes_without_a_copy() -> None:
    """Loading holds every layer's codes once, not twice (the load-time memory peak)."""
    q = rtn_quantize(torch.randn(16, 64), 32)
    layer = Int4Linear(q, None, backend="torch")
    assert layer.codes.data_ptr() == q.codes.data_ptr()
    x = torch.randn(3, 64)
    scales, mins = (t.half().float().repeat_interleave(32, 1) for t in (q.scales, q.mins))
    w = q.codes.float() * scales + mins
    torch.testing.assert_close(layer(x), x @ w.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch", [1, 3, 16])
def test_ternary_linear_computes_bitlinear(backend: str, batch: int) -> None:
    k, n = 75, 41
    linear = make_linear(k, n, seed=batch)
    layer = TernaryLinear.from_linear(linear, backend=backend)
    t = absmean_ternarize(linear.weight)
    x = torch.randn(batch, k, device=DEVICE)
    xq, x_scale = quantize_activations_ref(x)
    expected = (xq.float() @ t.values.float().t()) / x_scale[:, None] * t.scale + linear.bias

    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_quantize_linears_swaps_all_but_the_head() -> None:
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(64, 48))
    model.add_module("act", nn.ReLU())
    model.add_module("lm_head", nn.Linear(48, 10))
    replaced = quantize_linears(model, "int4", group_size=32)
    assert replaced == ["proj"]
    assert isinstance(model.proj, Int4Linear) and type(model.lm_head) is nn.Linear
    assert model(torch.randn(2, 64)).shape == (2, 10)

    model = nn.Sequential(nn.Linear(32, 16))
    assert quantize_linears(model, "bitnet") == ["0"]
    assert isinstance(model[0], TernaryLinear)


def test_install_quantized_weights_checks_shapes() -> None:
    model = nn.Sequential(nn.Linear(64, 16, bias=False))
    install_quantized_weights(model, {"0": rtn_quantize(torch.randn(16, 64), 32)})
    assert isinstance(model[0], Int4Linear) and model[0].bias is None
    model = nn.Sequential(nn.Linear(64, 16))
    with pytest.raises(ValueError, match="checkpoint weight is 8x64"):
        install_quantized_weights(model, {"0": rtn_quantize(torch.randn(8, 64), 32)})
