"""The ternary C kernels (engine/cpu/ternary_kernels.c) against their plain-torch references, bit for bit,
and ``TernaryCpuLinear`` against ``TernaryLinear``'s torch path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.cpu import kernels, ternary
from engine.layers.quant.linear import TernaryLinear
from engine.layers.quant.weights import TernaryWeight
from engine.layers.ternary_linear import TernaryCpuLinear

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason="no C compiler: the CPU kernels cannot be built"
)
Q = gguf.GGMLQuantizationType


def random_values(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(-1, 2, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


def random_rows(m: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-2, 1, k)


def test_codes_round_trip_in_tq2_0_order_with_padding() -> None:
    values = random_values(5, 300)
    codes = ternary.pack_tq2(values)
    assert codes.shape == (5, 128) and codes.dtype == torch.uint8  # K padded to 512: two blocks of 64 bytes
    assert torch.equal(ternary.unpack_tq2(codes, 300), values)
    assert not ternary.unpack_tq2(codes, 512)[:, 300:].any()  # the padding is zero weights
    # TQ2_0: byte 32c + m of a block holds elements 128c + 32j + m in bits 2j, as T + 1
    for c, j, m in [(0, 0, 0), (0, 3, 31), (1, 2, 5)]:
        assert (int(codes[2, 32 * c + m]) >> 2 * j) & 3 == int(values[2, 128 * c + 32 * j + m]) + 1
    with pytest.raises(ValueError, match="ternary"):
        ternary.pack_tq2(torch.full((1, 4), 2, dtype=torch.int8))


@pytest.mark.parametrize("qtype", [Q.TQ2_0, Q.TQ1_0])
def test_gguf_ternary_blocks_give_what_gguf_dequantizes(qtype: Q) -> None:
    weight = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32)
    blocks = gguf.quants.quantize(weight, qtype)
    if qtype == Q.TQ2_0:
        codes, scales = ternary.tq2_from_gguf(blocks, (6, 512))
        values = ternary.unpack_tq2(codes, 512)
    else:
        values, scales = ternary.tq1_values(blocks, (6, 512))
    mine = (values.float().reshape(6, 2, 256) * scales.float()[..., None]).reshape(6, 512)
    assert torch.equal(mine, torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))


@pytest.mark.parametrize("k", [300, 1000, 7])
def test_activation_quantizer_is_bitnets_per_token_int8(k: int) -> None:
    """The vector paths' chunks, a block's tail and the padding; ties round half to even."""
    x = random_rows(7, k)
    x[3] = 0  # an all-zero row hits the absmax floor
    x[5] = torch.arange(k) % 9 - 4.5  # with absmax 127 the scale is exactly 1: every value a tie
    x[5, 0] = 127
    codes, scales, sums = ternary.quantize_rows_i8(x)
    ref_codes, ref_scales, ref_sums = ternary.quantize_rows_i8_ref(x)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales) and torch.equal(sums, ref_sums)
    assert int(codes.abs().max()) == 127 and not codes[3].any()
    assert scales[5] == 1 and codes[5, 1:5].tolist() == [-4, -2, -2, 0]  # -3.5 -2.5 -1.5 -0.5


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17])
@pytest.mark.parametrize(("n", "k"), [(16, 256), (7, 300), (45, 768), (33, 64)])
@pytest.mark.parametrize("scales", ["row", "block"])
def test_matmul_is_the_reference_bit_for_bit(rows: int, n: int, k: int, scales: str) -> None:
    codes = ternary.pack_tq2(random_values(n, k, seed=rows))
    generator = torch.Generator().manual_seed(n)
    if scales == "row":
        kwargs = {"row_scales": torch.rand(n, generator=generator) + 0.01}
    else:
        kwargs = {
            "block_scales": (torch.rand(n, ternary.padded(k) // 256, generator=generator) + 0.01).half()
        }
    x = random_rows(rows, k, seed=k)
    out = ternary.matmul_tq2(x, codes, **kwargs)
    assert torch.equal(out, ternary.matmul_tq2_ref(x, codes, **kwargs))


@pytest.mark.parametrize("rows", [1, 5])
def test_the_largest_partial_sums_stay_exact(rows: int) -> None:
    """Every weight +1 (code 2) or -1 against activations all at the absmax (codes +-127): the widest
    int16 partial sums a kernel keeps (the AVX2 one-row step sums 4 of its lanes before widening)."""
    values = torch.ones(12, 768, dtype=torch.int8)
    values[6:] = -1
    x = torch.ones(rows, 768)
    x[::2] = -3.0
    codes = ternary.pack_tq2(values)
    block_scales = (torch.rand(12, 3) + 0.01).half()
    for kwargs in ({"row_scales": torch.rand(12) + 0.01}, {"block_scales": block_scales}):
        out = ternary.matmul_tq2(x, codes, **kwargs)
        assert torch.equal(out, ternary.matmul_tq2_ref(x, codes, **kwargs))


def test_the_reference_is_the_dense_product_of_the_quantized_operands() -> None:
    """Independent of the kernel's formula: to float rounding, a plain matmul of what the codes stand for."""
    values, x = random_values(40, 512, seed=5), random_rows(6, 512, seed=2)
    block_scales = torch.rand(40, 2).half() + 0.5
    codes, act_scales, _ = ternary.quantize_rows_i8_ref(x)
    weight = (values.double().reshape(40, 2, 256) * block_scales.double()[..., None]).reshape(40, 512)
    dense = (codes.double() / act_scales.double()[:, None]) @ weight.t()
    out = ternary.matmul_tq2(x, ternary.pack_tq2(values), block_scales=block_scales)
    torch.testing.assert_close(out.double(), dense, rtol=1e-5, atol=1e-5)


def test_rows_do_not_depend_on_the_batch_or_the_thread_count() -> None:
    codes = ternary.pack_tq2(random_values(80, 768, seed=1))
    block_scales = (torch.rand(80, 3) + 0.01).half()
    x = random_rows(11, 768, seed=3)
    threads = torch.get_num_threads()
    for kwargs in ({"row_scales": torch.rand(80) + 0.01}, {"block_scales": block_scales}):
        try:
            torch.set_num_threads(2)
            batch = ternary.matmul_tq2(x, codes, **kwargs)
            torch.set_num_threads(1)
            one_thread = ternary.matmul_tq2(x, codes, **kwargs)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(batch, one_thread)
        for i in range(x.shape[0]):
            assert torch.equal(ternary.matmul_tq2(x[i : i + 1], codes, **kwargs)[0], batch[i])
            assert torch.equal(ternary.matmul_tq2(x[: i + 1], codes, **kwargs)[i], batch[i])


def test_a_prompt_longer_than_one_pass_over_the_weights_matches_the_reference() -> None:
    """More activation rows than one pass of the kernel holds (256 KiB of int8 rows: 128 rows of 2048)."""
    codes = ternary.pack_tq2(random_values(24, 2048, seed=4))
    row_scales = torch.rand(24) + 0.01
    x = random_rows(261, 2048, seed=6)
    assert torch.equal(
        ternary.matmul_tq2(x, codes, row_scales=row_scales),
        ternary.matmul_tq2_ref(x, codes, row_scales=row_scales),
    )


@pytest.mark.parametrize("n", [8, 6, 3])
def test_the_kernel_layout_interleaves_the_blocks_of_four_rows(n: int) -> None:
    """Block b of row r of a group of four (the last group the N % 4 left) at block 4g * nb + b * rows + r,
    and the block scales the same way; natural_layout undoes it."""
    codes = ternary.pack_tq2(random_values(n, 768, seed=n))
    block_scales = torch.rand(n, 3).half()
    laid_out, scales = ternary.kernel_layout(codes, block_scales)
    assert laid_out.shape == codes.shape and scales is not None and scales.shape == block_scales.shape
    blocks, flat_scales = laid_out.reshape(-1, ternary.BLOCK_BYTES), scales.reshape(-1)
    for row in range(n):
        first = row - row % 4
        rows = min(4, n - first)
        for b in range(3):
            index = first * 3 + b * rows + row - first
            assert torch.equal(blocks[index], codes[row, 64 * b : 64 * (b + 1)])
            assert flat_scales[index] == block_scales[row, b]
    back, back_scales = ternary.natural_layout(laid_out, scales)
    assert torch.equal(back, codes) and back_scales is not None and torch.equal(back_scales, block_scales)


def test_stacked_linears_with_rows_left_over_from_groups_of_four_are_the_parts() -> None:
    """Stacking goes through the row order: parts of 5 and 7 rows are not whole groups of four."""
    x = random_rows(3, 512, seed=3)
    parts = [
        TernaryCpuLinear(
            ternary.pack_tq2(random_values(n, 512, seed=n)), 512, block_scales=torch.rand(n, 2).half() + 0.1
        )
        for n in (5, 7)
    ]
    stacked = TernaryCpuLinear.stacked(parts)
    assert stacked is not None and stacked.block_scales is not None
    assert torch.equal(stacked(x), torch.cat([p(x) for p in parts], dim=1))
    assert torch.equal(stacked.dequantized_weight(), torch.cat([p.dequantized_weight() for p in parts]))


@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_is_ternary_linears_torch_path_bit_for_bit(bias: bool) -> None:
    weight = TernaryWeight(random_values(48, 96, seed=7), scale=0.0371)
    reference = TernaryLinear(weight, torch.randn(48) if bias else None, backend="torch")
    x = random_rows(9, 96, seed=8).reshape(3, 3, 96)
    for linear in (
        TernaryCpuLinear.from_linear(reference),
        TernaryCpuLinear.from_ternary(weight, reference.bias),
    ):
        assert torch.equal(linear(x), reference(x))
    assert torch.equal(TernaryCpuLinear.from_linear(reference)(x.bfloat16()), reference(x.bfloat16()))


def test_block_scales_a_row_shares_become_its_row_scale() -> None:
    codes = ternary.pack_tq2(random_values(4, 512))
    shared = torch.tensor([[0.5, 0.5], [0.25, 0.0], [0.0, 0.0], [1.0, 1.0]]).half()  # 0: a block of zeros
    assert TernaryCpuLinear(codes, 512, block_scales=shared).row_scales is not None
    varied = torch.tensor([[0.5, 0.25], [0.25, 0.25], [0.5, 0.5], [1.0, 1.0]]).half()
    linear = TernaryCpuLinear(codes, 512, block_scales=varied)
    assert linear.row_scales is None and linear.block_scales is not None
    assert linear.bits_per_weight() == 2 + 16 / 256


def test_bad_input_is_refused() -> None:
    codes = ternary.pack_tq2(random_values(4, 256))
    with pytest.raises(kernels.KernelError, match="do not fit"):
        ternary.matmul_tq2(torch.randn(2, 512), codes, row_scales=torch.ones(4))
    with pytest.raises(kernels.KernelError, match="not both"):
        ternary.matmul_tq2(torch.randn(2, 256), codes)


def _cpu_has_avx512() -> bool:
    return {"avx512f", "avx512bw", "f16c"} <= set(kernels._cpu_signature().split())


@pytest.mark.skipif(os.environ.get(kernels.AVX512_ENV) == "0", reason="this run is the AVX2 build")
@pytest.mark.skipif(
    not _cpu_has_avx512(), reason="the CPU has no AVX-512: the tests above ran the AVX2 kernel"
)
def test_the_avx2_kernel_passes_too(tmp_path: Path) -> None:
    """The tests above again in a process whose kernels are built without AVX-512 (as on an AVX2 CPU)."""
    env = {**os.environ, kernels.AVX512_ENV: "0", "TERN_KERNEL_CACHE": str(tmp_path)}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        __file__,
        "-k",
        "not avx2_kernel",
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


def test_no_rows_give_no_rows() -> None:
    codes = ternary.pack_tq2(random_values(4, 256))
    assert ternary.matmul_tq2(torch.empty(0, 256), codes, row_scales=torch.ones(4)).shape == (0, 4)
