"""The BitNet ternary kernels (activation quantization, 2-bit matmul) against torch references.

Runs in Triton's CPU interpreter without a GPU (engine.kernels turns it on), on CUDA otherwise.
"""

import pytest
import torch

from engine.kernels.ternary_matmul import (
    pack_ternary,
    quantize_activations,
    quantize_activations_ref,
    ternary_matmul,
    ternary_matmul_ref,
    unpack_ternary,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_ternary(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(-1, 2, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


def test_pack_roundtrip_and_padding() -> None:
    ternary = random_ternary(7, 37)
    qweight = pack_ternary(ternary)
    assert qweight.shape == (3, 7) and qweight.dtype == torch.int32
    assert torch.equal(unpack_ternary(qweight, 37), ternary)
    # the 11 padding rows of the last word decode to zero weights
    assert torch.equal(unpack_ternary(qweight, 48)[:, 37:], torch.zeros(7, 11, dtype=torch.int8))
    with pytest.raises(ValueError, match="ternary"):
        pack_ternary(torch.full((2, 16), 2, dtype=torch.int8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_activations_matches_reference(dtype: torch.dtype) -> None:
    x = torch.randn(19, 150, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    x[3] = 0  # an all-zero row hits the absmax floor
    xq, scale = quantize_activations(x)
    xq_ref, scale_ref = quantize_activations_ref(x)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    diff = (xq.int() - xq_ref.int()).abs()
    # torch's division may differ from the kernel's correctly rounded one by an ulp, which can move
    # a value sitting on a rounding tie by one step; anything more is a bug.
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01
    assert xq.abs().max() == 127 and torch.all(xq[3] == 0)


def test_round_half_to_even_like_torch() -> None:
    # absmax 127 -> scale 1: the values themselves are rounded
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.0]], device=DEVICE)
    xq, _ = quantize_activations(x)
    assert xq.tolist() == [[0, 2, 2, 0, -2, -2, 126, 127]]


@pytest.mark.parametrize("batch", [1, 3, 16, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(45, 100), (33, 161)])
def test_ternary_matmul_matches_reference(batch: int, dtype: torch.dtype, n: int, k: int) -> None:
    qweight = pack_ternary(random_ternary(n, k, seed=batch)).to(DEVICE)
    w_scale = torch.tensor([0.043], device=DEVICE)
    x = torch.randn((batch, k), generator=torch.Generator().manual_seed(k)).to(DEVICE, dtype)

    out = ternary_matmul(x, qweight, w_scale)
    ref = ternary_matmul_ref(x, qweight, w_scale)

    assert out.shape == (batch, n) and out.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())


def test_ternary_matmul_equals_dense_matmul_of_quantized_operands() -> None:
    """Independent of the reference: the kernel is a plain matmul of the dequantized operands."""
    n, k = 40, 77
    ternary = random_ternary(n, k, seed=5)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
    xq, x_scale = quantize_activations_ref(x)
    dense = (xq.double() / x_scale.double()[:, None]) @ (ternary.double() * 0.5).t()
    out = ternary_matmul(x.to(DEVICE), pack_ternary(ternary).to(DEVICE), torch.tensor([0.5], device=DEVICE))
    torch.testing.assert_close(out.double().cpu(), dense, rtol=1e-5, atol=1e-4)


def test_ternary_matmul_rejects_mismatched_k() -> None:
    qweight = pack_ternary(random_ternary(8, 32))
    with pytest.raises(ValueError, match="does not fit"):
        ternary_matmul(torch.randn(1, 64), qweight, torch.tensor([1.0]))
