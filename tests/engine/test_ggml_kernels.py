"""The C kernels of GGUF's own blocks (Q4_K, Q5_K, Q6_K, Q8_0, Q5_0) against the
plain reference (gguf's dequantization, then a float64 matmul), batch- and thread-independent
bitwise, and a small random GGUF of mixed types loaded onto them (docs/engine.md, "GGUF types")."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from engine.cpu import ggml_kernels, kernels
from engine.layers.ggml_linear import GgmlEmbedding, GgmlLinear, StackedLinear
from engine.loader import load_model
from engine.loader.linear_factory import CpuKernels, install_cpu_kernels
from tests.engine.ggml_files import MIXED_TYPES, Q, random_blocks, write_mixed_gguf
from tests.engine.test_cpu_kernels import assert_decoder_kernel_is_the_torch_path

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason="no C compiler: the CPU kernels cannot be built"
)
KQUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("ggml_type", KQUANTS)
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_kquant_kernel_matches_the_reference(ggml_type: Q, rows: int) -> None:
    blocks = torch.from_numpy(random_blocks(ggml_type, 37, 512, seed=rows))  # 37: a partial tile
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 3
    expected = ggml_kernels.matmul_ref(x, blocks, ggml_type)
    torch.testing.assert_close(
        ggml_kernels.matmul_kquant(x, blocks, ggml_type), expected, rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize("ggml_type", KQUANTS)
def test_kquant_extreme_codes_and_scales_do_not_overflow(ggml_type: Q) -> None:
    """Every byte 0xFF or 0x00 but the float16 scales: the largest codes and sub-scales the formats
    allow (Q6_K's -32 * -128), against rows at the activation quantizer's full range."""
    for fill in (0x00, 0xFF, 0x80):
        blocks = torch.from_numpy(random_blocks(ggml_type, 16, 512))
        scales = blocks.clone()
        blocks.fill_(fill)
        offsets = {Q.Q6_K: [208, 209]}.get(ggml_type, [0, 1, 2, 3])
        per_block = blocks.view(16, 2, -1)
        per_block[..., offsets] = scales.view(16, 2, -1)[..., offsets]
        x = torch.full((2, 512), 1.0)
        x[1] *= -1
        expected = ggml_kernels.matmul_ref(x, blocks, ggml_type)
        torch.testing.assert_close(
            ggml_kernels.matmul_kquant(x, blocks, ggml_type), expected, rtol=1e-5, atol=1e-3
        )


def assert_rows_are_batch_and_thread_independent(matmul: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Bitwise: 2 threads against 1, and each row alone and as the last of a growing batch."""
    x = torch.randn(11, 768)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = matmul(x)
        torch.set_num_threads(1)
        assert torch.equal(matmul(x), batch)
    finally:
        torch.set_num_threads(threads)
    for i in range(x.shape[0]):
        assert torch.equal(matmul(x[i : i + 1])[0], batch[i])
        assert torch.equal(matmul(x[: i + 1])[i], batch[i])


@pytest.mark.parametrize("ggml_type", KQUANTS)
def test_kquant_rows_do_not_depend_on_the_batch_or_threads(ggml_type: Q) -> None:
    blocks = torch.from_numpy(random_blocks(ggml_type, 70, 768))
    assert_rows_are_batch_and_thread_independent(lambda x: ggml_kernels.matmul_kquant(x, blocks, ggml_type))


def test_q8_0_blocks_run_as_q8_0_exactly() -> None:
    """The row-by-row path (CPUs without AVX2; the tiles: test_q8_0_tiles.py)."""
    raw = random_blocks(Q.Q8_0, 20, 256)
    dense = ggml_kernels.dequantize_ref(raw, Q.Q8_0)
    linear = GgmlLinear(torch.from_numpy(raw.copy()), Q.Q8_0, 256, tile=False)
    assert linear.format == "q8_0" and linear.scales is not None
    # the codes and scales give gguf's dequantized weight back exactly
    codes = linear.qweight.float().reshape(20, -1, 32) * linear.scales.float()[..., None]
    assert torch.equal(codes.reshape(20, 256), dense)
    x = torch.randn(3, 256)
    torch.testing.assert_close(linear(x), ggml_kernels.matmul_ref(x, raw, Q.Q8_0), rtol=1e-5, atol=1e-4)


def _q5_0_blocks(rows: int, width: int, fill: int | None = None, seed: int = 0) -> np.ndarray:
    """Random Q5_0 blocks; with ``fill``, every fifth-bit and nibble byte that value (the extremes:
    0x00 all codes -16, 0xFF all +15)."""
    raw = random_blocks(Q.Q5_0, rows, width, seed=seed)
    if fill is not None:
        raw.reshape(rows, -1, 22)[..., 2:] = fill
    return raw


def _as_q8_0(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0 blocks as the same weights in Q8_0 (codes q - 16, the same scales): gguf's dequantized
    values divided by their scale, exact (a 5-bit code times a float16 fits float32's mantissa)."""
    rows = raw.shape[0]
    scales = torch.from_numpy(raw.reshape(rows, -1, 22)[..., :2].copy()).view(torch.float16).reshape(rows, -1)
    dense = ggml_kernels.dequantize_ref(raw, Q.Q5_0).reshape(rows, -1, 32)
    codes = (dense / scales.float()[..., None]).round()
    assert torch.equal(codes * scales.float()[..., None], dense)
    return codes.to(torch.int8).reshape(rows, -1), scales.contiguous()


@pytest.mark.parametrize("fill", [None, 0x00, 0xFF, 0x80])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_the_q5_0_kernel_matches_the_reference_and_q8_0(fill: int | None, rows: int) -> None:
    """On the file's bytes split in place: gguf's dequantization times the int16 rows within float32
    rounding, and bit for bit the Q8_0 kernel on the same weights (its arithmetic after unpacking). The
    row-by-row path, CPUs without AVX2 (the tiles: test_q8_0_tiles.py)."""
    raw = _q5_0_blocks(37, 576, fill, seed=rows)  # 37: a partial tile; 576: the default model's width
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)) * 3
    linear = GgmlLinear(torch.from_numpy(raw.copy()), Q.Q5_0, 576, tile=False)
    assert linear.format == "q5_0" and linear.qweight.shape == (37, 18 * 20)
    out = linear(x)
    torch.testing.assert_close(out, ggml_kernels.matmul_ref(x, raw, Q.Q5_0), rtol=1e-5, atol=1e-4)
    assert torch.equal(out, kernels.matmul_q8_0(x, *_as_q8_0(raw)))
    ids = torch.tensor([[0, 36], [5, 5]])  # a tied head's embedding rows: gguf's, from the split bytes
    assert torch.equal(linear.dequantized_rows(ids), ggml_kernels.dequantize_ref(raw, Q.Q5_0)[ids])


def test_q5_0_rows_do_not_depend_on_the_batch_or_threads() -> None:
    codes, scales = ggml_kernels.q5_0_from_blocks(torch.from_numpy(_q5_0_blocks(70, 768)))
    assert_rows_are_batch_and_thread_independent(lambda x: ggml_kernels.matmul_q5_0(x, codes, scales))


@pytest.mark.parametrize("ggml_type", [Q.Q6_K, Q.Q8_0, Q.Q5_0])
def test_embedding_rows_are_the_dequantized_table(ggml_type: Q) -> None:
    """A tied head's rows (Gemma-3-1B's Q8_0, Llama-3.2-1B's Q6_K) are the float table's, whatever
    shape the ids come in."""
    raw = random_blocks(ggml_type, 30, 256)
    expected_table = ggml_kernels.dequantize_ref(raw, ggml_type)
    head = GgmlLinear(torch.from_numpy(raw.copy()), ggml_type, 256, rows_looked_up=True)  # 30 rows: not tiled
    for ids in (torch.tensor([[0, 29, 7], [7, 3, 3]]), torch.tensor([5, 5, 0, 29]), torch.tensor([11])):
        expected = expected_table[ids]
        assert torch.equal(GgmlEmbedding((torch.from_numpy(raw), ggml_type), 256)(ids), expected)
        assert torch.equal(GgmlEmbedding(head, 256)(ids), expected)


def _has_avx512() -> bool:
    return {"avx512f", "avx512bw", "f16c"} <= set(kernels._cpu_signature().split())


@pytest.mark.skipif(os.environ.get(kernels.AVX512_ENV) == "0", reason="this run is the AVX2 build")
@pytest.mark.skipif(not _has_avx512(), reason="the CPU has no AVX-512: the AVX2 kernels are the ones tested")
def test_the_kquant_tests_pass_with_the_avx2_kernels(tmp_path: Path) -> None:
    """The kernel tests above, the mixed GGUF's (the C decode layers on the tiles) and the tiles'
    (test_kquant_tiles.py: the AVX2 tiles against the reference, and bit for bit against this process's
    AVX-512 tiles) again in a process whose kernels are built without AVX-512, and that build has no
    AVX-512 instruction: no zmm register anywhere in it."""
    from tests.engine import test_kquant_tiles as tiles  # it imports this module's batch checker

    expected = tmp_path / "tiles.pt"
    torch.save(tiles.kquant_tiles_outputs(), expected)
    env = {**os.environ, kernels.AVX512_ENV: "0", "TERN_KERNEL_CACHE": str(tmp_path)}
    env[tiles.EXPECTED_ENV] = str(expected)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, tiles.__file__]
    command += ["-k", "kquant or q5_0 or tile or mixed_gguf"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout, result.stdout[-500:]
    (library,) = tmp_path.glob("tern_cpu_kernels-*.so")
    tiles.assert_no_avx512(library)


def _logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))


@pytest.mark.parametrize(
    ("embedding", "output"), [(Q.Q6_K, None), (Q.Q4_K, Q.Q6_K), (Q.Q8_0, None), (Q.Q4_0, Q.Q8_0)]
)
def test_a_mixed_gguf_loads_in_its_own_blocks(
    tmp_path: Path, embedding: Q, output: Q | None, one_thread: None
) -> None:
    """A Q4_K_M-like file (Q4_K, Q5_K, Q6_K, Q8_0, Q5_0 linears): every linear, the head and the
    embedding on their blocks, q/k/v and gate/up stacked as parts, the C decode layers attached;
    logits within the activations' rounding of the file dequantized to float32: int16 rows, or the
    tiles' int8 ones (llama.cpp's Q8_K; 0.6% of a linear's largest output on these random weights,
    2.6% of the largest logit after two layers)."""
    path = write_mixed_gguf(tmp_path / "mixed.gguf", MIXED_TYPES, embedding, output)
    exact = load_model(path, progress=False)
    kept = load_model(path, progress=False, keep_gguf_int4=True, keep_gguf_blocks=True)
    model = kept.model
    assert isinstance(model.model.embed_tokens, GgmlEmbedding)
    assert isinstance(model.lm_head, GgmlLinear)
    layer = model.model.layers[0]
    formats = {
        name: layer.get_submodule(name).format
        for name in ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj")
    }
    tiled = "_tiled" if ggml_kernels.tiled_isa() else ""  # 256 and 128 rows: whole tiles
    assert formats == {
        "self_attn.q_proj": "q4_k" + tiled,
        "self_attn.v_proj": "q6_k" + tiled,
        "mlp.up_proj": "q5_0" + tiled,
    }
    assert not any(type(m) is nn.Linear for m in model.modules())  # no float weight anywhere
    ids = [3, 70, 101, 200, 12, 256, 9]
    expected = _logits(exact.model, ids)
    atol = (4e-2 if tiled else 2e-3) * expected.abs().max().item()
    torch.testing.assert_close(_logits(model, ids), expected, rtol=0, atol=atol)
    assert install_cpu_kernels(model, CpuKernels.C_F32).steps_in_c
    assert isinstance(layer.self_attn.qkv_proj, StackedLinear) and isinstance(
        layer.mlp.gate_up_proj, StackedLinear
    )
    assert model.model.decode_kernel is not None
    torch.testing.assert_close(_logits(model, ids), expected, rtol=0, atol=atol)
    # decode steps through the one-call C layers (the parts chained) are the torch path's, bit for bit
    assert_decoder_kernel_is_the_torch_path(model)
