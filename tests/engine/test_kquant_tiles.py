"""The K-quant tiles (Q4_K, Q5_K, Q6_K tile by tile against int8 Q8_K rows) and the Q8_0 and Q5_0 tiles
(against llama.cpp's Q8_0 activation blocks, ``engine/cpu/q8_0_tiles.py``) on each instruction set a
build can pick (``ggml_kernels.tiled_isa``: AVX-512 VNNI, 256-bit VNNI, AVX2): against the plain
reference, bitwise batch- and thread-independent, and the same bits on all three. This machine's build
runs here; test_ggml_kernels.py reruns this file with the AVX2 build (``TERN_CPU_AVX512=0``, checked to
hold no AVX-512 instruction) and the test below with 256-bit VNNI (``TERN_CPU_VNNI=0`` on an AVX-512
VNNI CPU), each compared bit for bit with this process's outputs (docs/engine.md, "GGUF types")."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.cpu import ggml_kernels, kernels, q8_0_tiles
from engine.layers.ggml_linear import GgmlEmbedding, GgmlLinear
from tests.engine.ggml_files import Q, random_blocks
from tests.engine.test_ggml_kernels import assert_rows_are_batch_and_thread_independent

pytestmark = pytest.mark.skipif(
    not kernels.available() or ggml_kernels.tiled_isa() is None,
    reason="the K-quant tiles need a C compiler and AVX2",
)
KQUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
BLOCKS_OF_32 = [Q.Q8_0, Q.Q5_0]
EXPECTED_ENV = "TERN_TEST_TILES_EXPECTED"
"""A file of :func:`kquant_tiles_outputs` from another build, which this one's must equal bit for bit."""


def _flags() -> set[str]:
    return set(kernels._cpu_signature().split())


def test_the_build_picks_the_widest_tiles_the_cpu_and_the_switches_allow() -> None:
    flags, avx512_off = _flags(), os.environ.get(kernels.AVX512_ENV) == "0"
    avx512_vnni = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags and not avx512_off
    if avx512_vnni and os.environ.get(kernels.VNNI_ENV) != "0":
        assert ggml_kernels.tiled_isa() == "avx512-vnni"
    elif avx512_vnni or "avx_vnni" in flags:  # TERN_CPU_VNNI=0 keeps AVX-512 VNNI's 256-bit vpdpbusd
        assert ggml_kernels.tiled_isa() == "avx-vnni"
    else:
        assert ggml_kernels.tiled_isa() == "avx2"


@pytest.mark.parametrize("ggml_type", KQUANTS)
@pytest.mark.parametrize("rows", [1, 4, 5, 9, 17])
def test_tiled_kquant_kernels_match_the_reference_and_the_batch(ggml_type: Q, rows: int) -> None:
    raw = random_blocks(ggml_type, 48, 512, seed=rows)
    tiled = ggml_kernels.tile(torch.from_numpy(raw.copy()), ggml_type)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 3
    out = ggml_kernels.matmul_tiled(x, tiled, ggml_type)
    expected = ggml_kernels.matmul_ref_q8k(x, raw, ggml_type)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    for i in range(rows):
        assert torch.equal(ggml_kernels.matmul_tiled(x[i : i + 1], tiled, ggml_type)[0], out[i])


@pytest.mark.parametrize("ggml_type", KQUANTS)
def test_tiled_kquant_rows_do_not_depend_on_the_batch_or_threads(ggml_type: Q) -> None:
    tiled = ggml_kernels.tile(torch.from_numpy(random_blocks(ggml_type, 64, 768)), ggml_type)
    assert_rows_are_batch_and_thread_independent(lambda x: ggml_kernels.matmul_tiled(x, tiled, ggml_type))


def test_the_tiles_activation_quantizer_is_the_plain_reference() -> None:
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(3)) * 4
    x[1, :256] = 0.0  # a block of zeros: scale 0, codes 0
    x[2, 300] = 1e4  # one outlier: the rest of its block rounds to 0
    x[3] = x[3].round() / 8  # halves: ties round to even
    got = ggml_kernels.quantize_rows_q8k(x)
    for tensor, reference in zip(got, ggml_kernels.quantize_rows_q8k_ref(x), strict=True):
        assert torch.equal(tensor, reference)
    assert got[0].abs().max() == 127 and got[1][1, 0] == 0


@pytest.mark.parametrize("ggml_type", KQUANTS)
def test_tiled_kquant_extreme_codes_and_scales_do_not_overflow(ggml_type: Q) -> None:
    """Every byte 0xFF, 0x00 or 0x80 but the float16 scales, against rows at +-127: the largest int16
    pair sums AVX2 keeps (Q4_K 8 chunks, Q5_K 4, Q6_K 2)."""
    for fill in (0x00, 0xFF, 0x80):
        blocks = torch.from_numpy(random_blocks(ggml_type, 16, 512))
        scales = blocks.clone()
        blocks.fill_(fill)
        offsets = {Q.Q6_K: [208, 209]}.get(ggml_type, [0, 1, 2, 3])
        blocks.view(16, 2, -1)[..., offsets] = scales.view(16, 2, -1)[..., offsets]
        x = torch.full((2, 512), 1.0)
        x[1] *= -1
        expected = ggml_kernels.matmul_ref_q8k(x, blocks, ggml_type)
        out = ggml_kernels.matmul_tiled(x, ggml_kernels.tile(blocks.clone(), ggml_type), ggml_type)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-3)


def test_q6_k_one_row_at_the_widest_int16_sums_is_the_batchs() -> None:
    """One row alone (the one-row passes, ``row16`` on AVX2, ``row`` on AVX-512) at the AVX2 int16 sums'
    bound: every code 63 (0xFF: q - 32 = 31), 0 (0x00: q - 32 = -32) or a mix (0x80) against rows at
    +127, -127 and both; AVX2 sums two codes' vpmaddubsw pairs in int16, unsigned codes, at most
    2 * 2 * 63 * 127 = 32004 < 2^15 (four would be 64008: saturated, the wrong bits). Bit for bit the
    rows in a batch (the multi-row tiles), and near the reference."""
    for fill in (0xFF, 0x00, 0x80):
        blocks = torch.from_numpy(random_blocks(Q.Q6_K, 32, 512, seed=fill))
        scales = blocks.clone()
        blocks.fill_(fill)
        blocks.view(32, 2, -1)[..., [208, 209]] = scales.view(32, 2, -1)[..., [208, 209]]
        tiled = ggml_kernels.tile(blocks.clone(), Q.Q6_K)
        x = torch.tensor([1.0, -1.0, 2.5]).repeat_interleave(512).view(3, 512)
        x[2, ::3] = -2.5  # mixed signs
        batch = ggml_kernels.matmul_tiled(x, tiled, Q.Q6_K)
        torch.testing.assert_close(
            batch, ggml_kernels.matmul_ref_q8k(x, blocks, Q.Q6_K), rtol=1e-5, atol=1e-3
        )
        for i in range(3):
            assert torch.equal(ggml_kernels.matmul_tiled(x[i : i + 1], tiled, Q.Q6_K)[0], batch[i])


def test_a_tied_q6_k_heads_tiles_give_the_embedding_rows_back() -> None:
    raw = random_blocks(Q.Q6_K, 32, 512)
    head = GgmlLinear(torch.from_numpy(raw.copy()), Q.Q6_K, 512, rows_looked_up=True)
    assert head.format == "q6_k_tiled"
    ids = torch.tensor([[0, 31, 17], [16, 15, 15]])
    expected = ggml_kernels.dequantize_ref(raw, Q.Q6_K)[ids]
    torch.testing.assert_close(GgmlEmbedding(head, 512)(ids), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("ggml_type", BLOCKS_OF_32)
@pytest.mark.parametrize("rows", [1, 5, 9, 17])
def test_q8_0_and_q5_0_tiles_match_the_reference_and_the_batch(ggml_type: Q, rows: int) -> None:
    """37 weight rows (a short last tile), K 1,152 (Gemma-3-1B's hidden size, not a multiple of 256)."""
    raw = random_blocks(ggml_type, 37, 1152, seed=rows)
    tiled = q8_0_tiles.tile(torch.from_numpy(raw.copy()), ggml_type)
    x = torch.randn(rows, 1152, generator=torch.Generator().manual_seed(rows)) * 3
    out = q8_0_tiles.matmul(x, tiled, ggml_type)
    torch.testing.assert_close(out, q8_0_tiles.matmul_ref(x, raw, ggml_type), rtol=1e-5, atol=1e-4)
    for i in range(rows):
        assert torch.equal(q8_0_tiles.matmul(x[i : i + 1], tiled, ggml_type)[0], out[i])


@pytest.mark.parametrize("ggml_type", BLOCKS_OF_32)
def test_q8_0_and_q5_0_tile_rows_do_not_depend_on_the_batch_or_threads(ggml_type: Q) -> None:
    tiled = q8_0_tiles.tile(torch.from_numpy(random_blocks(ggml_type, 70, 768)), ggml_type)
    assert_rows_are_batch_and_thread_independent(lambda x: q8_0_tiles.matmul(x, tiled, ggml_type))


def test_the_q8_0_tiles_activation_quantizer_is_the_plain_reference() -> None:
    x = torch.randn(5, 1152, generator=torch.Generator().manual_seed(3)) * 4
    x[1, :32] = 0.0  # a block of zeros: scale 0, codes 0
    x[2, 300] = 1e4  # one outlier: the rest of its block rounds to 0
    x[3] = x[3].round() / 8  # halves: ties round to even
    got = q8_0_tiles.quantize_rows_q8_0(x)
    for tensor, reference in zip(got, q8_0_tiles.quantize_rows_q8_0_ref(x), strict=True):
        assert torch.equal(tensor, reference)
    assert got[0].abs().max() == 127 and got[1][1, 0] == 0 and got[2][1, 0] == 0


@pytest.mark.parametrize("ggml_type", BLOCKS_OF_32)
def test_q8_0_and_q5_0_tiles_extreme_codes_do_not_overflow(ggml_type: Q) -> None:
    """Every code byte 0x00, 0xFF or 0x80 (Q8_0: -128 too, whose magnitude AVX2 reads as 128 unsigned;
    Q5_0: every code -16 or +15), against rows at +-127: the largest products AVX2 sums in int16."""
    for fill in (0x00, 0xFF, 0x80):
        raw = random_blocks(ggml_type, 21, 512)
        raw.reshape(21, 16, -1)[..., 2:] = fill
        x = torch.full((2, 512), 1.0)
        x[1] *= -1
        out = q8_0_tiles.matmul(x, q8_0_tiles.tile(torch.from_numpy(raw.copy()), ggml_type), ggml_type)
        torch.testing.assert_close(out, q8_0_tiles.matmul_ref(x, raw, ggml_type), rtol=1e-5, atol=1e-3)


def test_q5_0_tiles_are_its_exact_q8_0_conversions_tiles_bit_for_bit() -> None:
    """Q5_0's unsigned codes q less 16 times the row's block sum is the integer dot of the codes q - 16,
    which a Q8_0 weight of those codes and the same scales gives: the same bits."""
    raw = random_blocks(Q.Q5_0, 37, 1152, seed=2)
    scales = raw.reshape(37, -1, 22)[..., :2]
    codes = (
        ggml_kernels.dequantize_ref(raw, Q.Q5_0).reshape(37, -1, 32)
        / torch.from_numpy(scales.copy()).view(torch.float16).float()
    )
    q8_0 = np.concatenate((scales, codes.round().to(torch.int8).numpy().view(np.uint8)), axis=-1)
    x = torch.randn(9, 1152) * 2
    as_q5_0 = q8_0_tiles.matmul(x, q8_0_tiles.tile(torch.from_numpy(raw), Q.Q5_0), Q.Q5_0)
    q8_0_weight = q8_0_tiles.tile(torch.from_numpy(q8_0.reshape(37, -1).copy()), Q.Q8_0)
    assert torch.equal(as_q5_0, q8_0_tiles.matmul(x, q8_0_weight, Q.Q8_0))


@pytest.mark.parametrize("ggml_type", BLOCKS_OF_32)
def test_a_tied_q8_0_or_q5_0_heads_tiles_give_the_embedding_rows_back(ggml_type: Q) -> None:
    raw = random_blocks(ggml_type, 37, 1152)
    head = GgmlLinear(torch.from_numpy(raw.copy()), ggml_type, 1152, rows_looked_up=True)
    assert head.format == f"{ggml_type.name.lower()}_tiled"
    ids = torch.tensor([[0, 36, 17], [32, 15, 15]])  # 32..36: the short last tile
    assert torch.equal(GgmlEmbedding(head, 1152)(ids), ggml_kernels.dequantize_ref(raw, ggml_type)[ids])
    x = torch.randn(3, 1152)
    assert torch.equal(
        head(x), q8_0_tiles.matmul(x, q8_0_tiles.tile(torch.from_numpy(raw), ggml_type), ggml_type)
    )


def test_a_q5_0_output_head_keeps_the_int16_row_tiles() -> None:
    """An output head's near-ties are its token choices (ggml_linear.HEADS_ON_INT16_ROWS): Q5_0's (rare)
    stay on the row-by-row tiles."""
    raw = random_blocks(Q.Q5_0, 37, 576)
    head = GgmlLinear(torch.from_numpy(raw.copy()), Q.Q5_0, 576, rows_looked_up=True, head=True)
    assert head.format == "q5_0" and head.scales is not None and head.int16_head
    x = torch.randn(2, 576)
    torch.testing.assert_close(head(x), ggml_kernels.matmul_ref(x, raw, Q.Q5_0), rtol=1e-5, atol=1e-4)


def test_a_tied_q8_0_output_head_runs_its_tiles_on_int16_rows() -> None:
    """The int8 tiles' layout (the embedding's rows from it), the row tiles' int16 activations."""
    raw = random_blocks(Q.Q8_0, 37, 576)
    head = GgmlLinear(torch.from_numpy(raw.copy()), Q.Q8_0, 576, rows_looked_up=True, head=True)
    assert head.format == "q8_0_tiled" and head.int16_head and "int16 rows" in repr(head)
    ids = torch.tensor([[0, 36, 17], [32, 15, 15]])  # 32..36: the short last tile
    assert torch.equal(GgmlEmbedding(head, 576)(ids), ggml_kernels.dequantize_ref(raw, Q.Q8_0)[ids])
    x = torch.randn(3, 576)
    tiled = q8_0_tiles.tile(torch.from_numpy(raw.copy()), Q.Q8_0)
    assert torch.equal(head(x), q8_0_tiles.matmul_head(x, tiled))
    # the same int16 rows as the row-by-row tiles (kernels.matmul_q8_0): only the float sums' order differs
    codes, scales = ggml_kernels.q8_0_from_blocks(torch.from_numpy(raw.copy()))
    torch.testing.assert_close(head(x), kernels.matmul_q8_0(x, codes, scales), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("k", [576, 1152])
@pytest.mark.parametrize("rows", [1, 4, 9, 17])
def test_q8_0_head_tiles_match_the_int16_reference_and_the_batch(k: int, rows: int) -> None:
    """37 weight rows (not a multiple of 16: a short last tile), K of SmolLM2-135M and Gemma-3-1B."""
    raw = random_blocks(Q.Q8_0, 37, k, seed=rows)
    tiled = q8_0_tiles.tile(torch.from_numpy(raw.copy()), Q.Q8_0)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    out = q8_0_tiles.matmul_head(x, tiled)
    torch.testing.assert_close(out, q8_0_tiles.matmul_head_ref(x, raw), rtol=1e-5, atol=1e-4)
    for i in range(rows):
        assert torch.equal(q8_0_tiles.matmul_head(x[i : i + 1], tiled)[0], out[i])


def test_q8_0_head_tile_rows_do_not_depend_on_the_batch_or_threads() -> None:
    tiled = q8_0_tiles.tile(torch.from_numpy(random_blocks(Q.Q8_0, 70, 768)), Q.Q8_0)
    assert_rows_are_batch_and_thread_independent(lambda x: q8_0_tiles.matmul_head(x, tiled))


def test_q8_0_head_tiles_extreme_codes_do_not_overflow() -> None:
    """Every code -128 (byte 0x00 in the tiles), 127 or 0, against rows whose codes are all +-32767:
    each block's dot at its bound, 32 * 128 * 32767, and the unsigned partial sums beyond it."""
    for fill in (0x80, 0x7F, 0x00):
        raw = random_blocks(Q.Q8_0, 21, 1152)
        raw.reshape(21, 36, -1)[..., 2:] = fill
        x = torch.full((3, 1152), 1.0)
        x[1] *= -1
        x[2, ::2] *= -1
        out = q8_0_tiles.matmul_head(x, q8_0_tiles.tile(torch.from_numpy(raw.copy()), Q.Q8_0))
        torch.testing.assert_close(out, q8_0_tiles.matmul_head_ref(x, raw), rtol=1e-5, atol=1e-3)


def kquant_tiles_outputs() -> dict[str, torch.Tensor]:
    """Each K-quant's tiles on fixed random weights and rows (1, 4, 7 and 13 rows: every tail), and
    Q8_0's and Q5_0's (37 rows: a short last tile; K 1,152, Gemma-3-1B's, not a multiple of 256), and
    Q8_0 heads' on int16 rows (K 576 and 1,152)."""
    outputs = {}
    for ggml_type in KQUANTS:
        raw = random_blocks(ggml_type, 32, 768, seed=5)
        tiled = ggml_kernels.tile(torch.from_numpy(raw), ggml_type)
        for rows in (1, 4, 7, 13):
            x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)) * 2
            outputs[f"{ggml_type.name}-{rows}"] = ggml_kernels.matmul_tiled(x, tiled, ggml_type)
    for ggml_type in BLOCKS_OF_32:
        tiled = q8_0_tiles.tile(torch.from_numpy(random_blocks(ggml_type, 37, 1152, seed=5)), ggml_type)
        for rows in (1, 4, 7, 13):
            x = torch.randn(rows, 1152, generator=torch.Generator().manual_seed(rows)) * 2
            outputs[f"{ggml_type.name}-{rows}"] = q8_0_tiles.matmul(x, tiled, ggml_type)
    for k in (576, 1152):  # Q8_0 heads on int16 rows (q8_0_head_tiles.c)
        tiled = q8_0_tiles.tile(torch.from_numpy(random_blocks(Q.Q8_0, 37, k, seed=6)), Q.Q8_0)
        for rows in (1, 4, 7, 13):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2
            outputs[f"Q8_0-head-{k}-{rows}"] = q8_0_tiles.matmul_head(x, tiled)
    return outputs


@pytest.mark.skipif(EXPECTED_ENV not in os.environ, reason="run by another build's test, with its outputs")
def test_the_tiles_are_the_other_builds_bit_for_bit() -> None:
    expected = torch.load(os.environ[EXPECTED_ENV])
    got = kquant_tiles_outputs()
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name


def assert_no_avx512(library: Path) -> None:
    """No AVX-512 instruction in a built library: no zmm register and no opmask in its code."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump to read the build with")
    code = subprocess.run([objdump, "-d", str(library)], capture_output=True, text=True, check=True).stdout
    assert "vpmaddubsw" in code  # the AVX2 tiles are in it
    assert "%zmm" not in code and "{%k" not in code


@pytest.mark.skipif(
    os.environ.get(kernels.VNNI_ENV) == "0" or os.environ.get(kernels.AVX512_ENV) == "0",
    reason="this run is a build without AVX-512 VNNI's tiles",
)
@pytest.mark.skipif(ggml_kernels.tiled_isa() != "avx512-vnni", reason="the build's tiles are not AVX-512's")
def test_the_tiles_pass_with_256_bit_vnni(tmp_path: Path) -> None:
    """This file again where the tiles are 256-bit VNNI's (``TERN_CPU_VNNI=0``: AVX-VNNI's code on
    AVX-512 VNNI's 256-bit vpdpbusd), bit for bit this process's AVX-512 tiles."""
    expected = tmp_path / "tiles.pt"
    torch.save(kquant_tiles_outputs(), expected)
    env = {**os.environ, kernels.VNNI_ENV: "0", "TERN_KERNEL_CACHE": str(tmp_path)}
    env[EXPECTED_ENV] = str(expected)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout, result.stdout[-500:]
