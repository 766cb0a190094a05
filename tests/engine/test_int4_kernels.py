"""The fused INT4 dequant+matmul kernel against its plain-torch reference.

Runs in Triton's CPU interpreter without a GPU (engine.kernels turns it on), on CUDA otherwise.
Shapes are small and ragged: N, K and M are not multiples of any block size.
"""

import pytest
import torch

from engine.kernels.int4_matmul import (
    dequantize_int4,
    int4_matmul,
    int4_matmul_ref,
    pack_int4,
    unpack_int4_codes,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_int4(n: int, k: int, group_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_groups = -(-k // group_size)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand((n, num_groups), generator=gen) * 0.05 + 0.01
    mins = -8 * scales + torch.randn((n, num_groups), generator=gen) * 0.01
    return codes, scales, mins


def test_pack_roundtrip_keeps_codes_and_groups() -> None:
    n, k, g = 37, 90, 32
    codes, scales, mins = random_int4(n, k, g)
    qweight, packed_scales, packed_mins = pack_int4(codes, scales, mins, g)
    assert qweight.shape == (96 // 8, n) and qweight.dtype == torch.int32
    assert torch.equal(unpack_int4_codes(qweight)[:k].t(), codes)
    expected = codes.float() * packed_scales.float().t().repeat_interleave(g, 1)[:, :k]
    expected += packed_mins.float().t().repeat_interleave(g, 1)[:, :k]
    assert torch.equal(dequantize_int4(qweight, packed_scales, packed_mins, g, k), expected)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("batch", [1, 3, 16, 37])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_int4_matmul_matches_reference(group_size: int, batch: int, dtype: torch.dtype) -> None:
    n, k = 45, 2 * group_size + 24  # ragged in N and K; K is not a multiple of the group
    codes, scales, mins = random_int4(n, k, group_size, seed=group_size + batch)
    qweight, packed_scales, packed_mins = (t.to(DEVICE) for t in pack_int4(codes, scales, mins, group_size))
    x = torch.randn((batch, k), generator=torch.Generator().manual_seed(batch)).to(DEVICE, dtype)

    out = int4_matmul(x, qweight, packed_scales, packed_mins, group_size)
    ref = int4_matmul_ref(x, qweight, packed_scales, packed_mins, group_size)

    assert out.shape == (batch, n) and out.dtype == dtype
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())


def test_int4_matmul_keeps_leading_dims_and_strided_rows() -> None:
    n, k, g = 29, 64, 64
    codes, scales, mins = random_int4(n, k, g, seed=3)
    qweight, packed_scales, packed_mins = (t.to(DEVICE) for t in pack_int4(codes, scales, mins, g))
    x = torch.randn(2, 3, 2 * k, device=DEVICE)[..., :k]  # non-contiguous rows
    out = int4_matmul(x, qweight, packed_scales, packed_mins, g)
    ref = int4_matmul_ref(x, qweight, packed_scales, packed_mins, g)
    assert out.shape == (2, 3, n)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_int4_matmul_rejects_mismatched_layout() -> None:
    codes, scales, mins = random_int4(16, 64, 32)
    qweight, packed_scales, packed_mins = pack_int4(codes, scales, mins, 32)
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="group_size"):
        int4_matmul(x, qweight, packed_scales, packed_mins, 48)
    with pytest.raises(ValueError, match="does not fit"):
        int4_matmul(torch.randn(1, 100), qweight, packed_scales, packed_mins, 32)
    with pytest.raises(ValueError, match="scales/mins"):
        int4_matmul(x, qweight, packed_scales[:1], packed_mins, 32)
