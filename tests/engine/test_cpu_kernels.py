"""The C kernels of engine/cpu against their plain-torch references, and the drop-in linears on them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from engine.cpu import kernels
from engine.layers.attention_backends import CDecode, TorchDecode
from engine.layers.context import make_context, reset_context, set_context
from engine.layers.packed_linear import (
    Bf16Embedding,
    Int4PackedCpuLinear,
    Q4CpuLinear,
    Q8CpuLinear,
    Q8Embedding,
    activation_dtype,
)
from engine.layers.quant.linear import Int4Linear
from engine.loader.linear_factory import CpuKernels, install_cpu_kernels
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_decode_kernel import DecoderLayersKernel
from tests.engine.tiny_engine import make_tiny_model

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason="no C compiler: the CPU kernels cannot be built"
)


def q4_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=generator)
    scales = (torch.rand(n, k // 32, generator=generator) * 0.02 + 1e-3).half()
    mins = (-torch.rand(n, k // 32, generator=generator) * 0.15).half()
    return kernels.pack_q4_1(codes, scales, mins), scales, mins


def test_q4_1_packing_round_trips_in_gguf_order() -> None:
    codes = torch.randint(0, 16, (3, 64))
    packed = kernels.pack_q4_1(codes, torch.ones(3, 2), torch.zeros(3, 2))
    assert packed.shape == (3, 32)
    assert torch.equal(kernels.unpack_q4_1(packed), codes.to(torch.uint8))
    # GGUF's Q4_1: byte j of a block holds element j (low nibble) and element j + 16 (high nibble)
    assert packed[0, 0].item() == codes[0, 0].item() | codes[0, 16].item() << 4


def test_tiled_q4_1_pairs_the_codes_of_a_tiles_columns_for_the_vnni_kernel() -> None:
    codes = torch.randint(0, 16, (20, 64))
    tiled = kernels.tile_q4_1(kernels.pack_q4_1(codes, torch.ones(20, 2), torch.zeros(20, 2)))
    assert tiled.shape == (2, 2, 8, 32)  # [tiles of 16 columns, blocks, chunks, bytes]
    # chunk j's byte 2c + e: column c's element 4j + e in the low nibble, 4j + 2 + e in the high one
    for tile, block, j, c, e in [(0, 0, 0, 0, 0), (0, 1, 3, 5, 1), (1, 0, 7, 3, 0), (1, 1, 2, 2, 1)]:
        column, element = tile * 16 + c, block * 32 + 4 * j + e
        expected = codes[column, element].item() | codes[column, element + 2].item() << 4
        assert tiled[tile, block, j, 2 * c + e].item() == expected
    assert not tiled[1, :, :, 8:].any()  # columns 20 to 31 do not exist: zero codes


def _cpu_has_avx512_vnni() -> bool:
    return {"avx512f", "avx512bw", "avx512_vnni", "f16c"} <= set(kernels._cpu_signature().split())


@pytest.mark.skipif(not _cpu_has_avx512_vnni(), reason="the CPU has no AVX-512 VNNI")
def test_q4_1_reads_tile_by_tile_where_the_cpu_has_vnni_unless_vnni_or_avx512_is_turned_off() -> None:
    turned_off = "0" in (os.environ.get(kernels.VNNI_ENV), os.environ.get(kernels.AVX512_ENV))
    assert kernels.q4_1_tiled() == (not turned_off)


@pytest.mark.skipif(os.environ.get(kernels.VNNI_ENV) == "0", reason="this run is the build without VNNI")
@pytest.mark.skipif(not _cpu_has_avx512_vnni(), reason="the CPU has no AVX-512 VNNI")
def test_the_q4_1_tests_pass_with_vnni_turned_off(tmp_path: Path) -> None:
    """The q4_1 tests below again, in a process whose kernels are built with TERN_CPU_VNNI=0 (the AVX-512
    tiles' q4_1), so that both q4_1 kernels are tested on every machine that has AVX-512 VNNI."""
    env = {**os.environ, kernels.VNNI_ENV: "0", "TERN_KERNEL_CACHE": str(tmp_path)}
    selection = "q4 or rows_do_not_depend or long_rows or vnni"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", selection]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


def test_activation_quantizer_matches_reference() -> None:
    x = torch.randn(7, 96) * torch.logspace(-3, 2, 96)  # very different magnitudes within a row
    x[3] = 0  # an all-zero row: scale 0, codes 0
    codes, scales, sums = kernels.quantize_rows(x)
    ref_codes, ref_scales, ref_sums = kernels.quantize_rows_ref(x)
    assert torch.equal(codes, ref_codes)
    torch.testing.assert_close(scales, ref_scales, rtol=0, atol=0)
    torch.testing.assert_close(sums, ref_sums, rtol=1e-6, atol=1e-6)
    # 15 bits against the row's largest value: the round trip is within half a step of the input
    # (and the float rounding of x / scale and of code * scale: a few ulp of x)
    back = codes.float() * scales[:, None]
    assert ((back - x).abs() <= scales[:, None] / 2 + 4e-7 * x.abs()).all()


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17])
@pytest.mark.parametrize("n", [16, 40, 7])
def test_q4_1_matmul_matches_reference(rows: int, n: int) -> None:
    qweight, scales, mins = q4_weight(n, 96)
    x = torch.randn(rows, 96)
    out = kernels.matmul_q4_1(x, qweight, scales, mins)
    torch.testing.assert_close(out, kernels.matmul_q4_1_ref(x, qweight, scales, mins), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 4, 6])
def test_q8_0_matmul_matches_reference(rows: int) -> None:
    weight = torch.randn(40, 128)
    qweight, scales = kernels.quantize_q8_0(weight)
    x = torch.randn(rows, 128)
    out = kernels.matmul_q8_0(x, qweight, scales)
    torch.testing.assert_close(out, kernels.matmul_q8_0_ref(x, qweight, scales), rtol=1e-5, atol=1e-5)
    # and the whole chain is close to the float product (8-bit weights: about 0.6% off here)
    exact = x @ weight.t()
    assert (out - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize("rows", [1, 5])
def test_long_rows_match_reference(rows: int) -> None:
    """34 blocks a row: the scales are converted 8 and 16 at a time with a tail (the short rows above
    have 3 and 4), and q4_1's min term sums whole vectors of blocks."""
    k = 34 * 32
    qweight, scales, mins = q4_weight(19, k, seed=2)
    x = torch.randn(rows, k)
    out = kernels.matmul_q4_1(x, qweight, scales, mins)
    torch.testing.assert_close(out, kernels.matmul_q4_1_ref(x, qweight, scales, mins), rtol=1e-5, atol=1e-5)
    assert torch.equal(kernels.matmul_q4_1(x[-1:], qweight, scales, mins)[0], out[-1])
    q8_weight, q8_scales = kernels.quantize_q8_0(torch.randn(19, k))
    out = kernels.matmul_q8_0(x, q8_weight, q8_scales)
    torch.testing.assert_close(out, kernels.matmul_q8_0_ref(x, q8_weight, q8_scales), rtol=1e-5, atol=1e-5)
    assert torch.equal(kernels.matmul_q8_0(x[-1:], q8_weight, q8_scales)[0], out[-1])


def test_q8_0_requantization_gives_a_q8_0_tensor_its_codes_back() -> None:
    rows = 4100  # more than one chunk of the quantizer's rows
    codes = torch.randint(-127, 128, (rows, 64), dtype=torch.int8)
    codes[:, ::32] = 127  # every block reaches the full range, as GGUF's quantizer makes it
    scales = (torch.rand(rows, 2) + 0.01).half()  # float16, as GGUF stores them
    weight = (codes.float().reshape(rows, 2, 32) * scales.float()[..., None]).reshape(rows, 64)
    again, again_scales = kernels.quantize_q8_0(weight)
    assert torch.equal(again, codes)
    assert torch.equal(again_scales, scales)


def test_rows_do_not_depend_on_the_batch_or_the_thread_count() -> None:
    qweight, scales, mins = q4_weight(48, 128, seed=1)
    x = torch.randn(11, 128)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = kernels.matmul_q4_1(x, qweight, scales, mins)
        torch.set_num_threads(1)
        one_thread = kernels.matmul_q4_1(x, qweight, scales, mins)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, one_thread)
    for i in range(x.shape[0]):
        assert torch.equal(kernels.matmul_q4_1(x[i : i + 1], qweight, scales, mins)[0], batch[i])
        assert torch.equal(kernels.matmul_q4_1(x[: i + 1], qweight, scales, mins)[i], batch[i])


@pytest.mark.parametrize("group_size", [32, 128])
def test_q4_linear_is_a_drop_in_for_int4_linear(group_size: int) -> None:
    torch.manual_seed(0)
    linear = Int4Linear.from_linear(nn.Linear(256, 48, bias=True), group_size=group_size)
    fast = Q4CpuLinear(linear)
    x = torch.randn(2, 5, 256)
    torch.testing.assert_close(fast(x), linear(x), rtol=1e-4, atol=1e-4)


def test_q8_linear_is_a_drop_in_for_linear() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=False)
    fast = Q8CpuLinear(linear)
    x = torch.randn(3, 64)
    exact = linear(x)
    assert (fast(x) - exact).norm() / exact.norm() < 0.02


def test_bad_input_is_refused_in_one_line() -> None:
    qweight, scales, mins = q4_weight(16, 64)
    with pytest.raises(kernels.KernelError, match="float32"):
        kernels.matmul_q4_1(torch.randn(2, 64, dtype=torch.float64), qweight, scales, mins)
    with pytest.raises(kernels.KernelError, match="float16"):
        kernels.matmul_q4_1(torch.randn(2, 64), qweight, scales.float(), mins.float())
    with pytest.raises(kernels.KernelError, match="blocks of 32"):
        kernels.pack_q4_1(torch.zeros(2, 40, dtype=torch.long), torch.ones(2, 1), torch.zeros(2, 1))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("kv_heads", "dim"), [(1, 64), (3, 64), (2, 40)])
def test_paged_decode_attention_matches_reference(kv_heads: int, dim: int, cache_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 24, 16, kv_heads, dim).to(cache_dtype)
    tables = torch.randperm(24)[:20].to(torch.int32).reshape(4, 5)
    tables[0, 2:] = -1  # a short row's table is padded with -1 past its blocks
    lens = torch.tensor([17, 80, 1, 64], dtype=torch.int32)
    q = torch.randn(4, 3 * kv_heads, dim)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    ref = kernels.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # a row alone is bitwise the row in the batch
    alone = kernels.paged_decode_attention(q[1:2], k_cache, v_cache, tables[1:2], lens[1:2], 0.125)
    assert torch.equal(alone[0], out[1])


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (8, 1), (2, 2)])
def test_paged_decode_attention_over_long_rows_matches_reference_whatever_the_batch_and_threads(
    heads: int, kv_heads: int
) -> None:
    """Rows longer than a chunk of keys (128): the chunks' partial softmaxes merge to the reference,
    and a row's output is bit for bit the same alone, in a batch and on one thread or two."""
    torch.manual_seed(1)
    k_cache, v_cache = torch.randn(2, 80, 16, kv_heads, 64).half()
    tables = torch.randperm(80).to(torch.int32).reshape(2, 40)
    lens = torch.tensor([640, 129], dtype=torch.int32)
    q = torch.randn(2, heads, 64)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    ref = kernels.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for row in range(2):
            alone = kernels.paged_decode_attention(
                q[row : row + 1], k_cache, v_cache, tables[row : row + 1], lens[row : row + 1], 0.125
            )
            assert torch.equal(alone[0], out[row])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("window", [1, 100, 200, 1000])
def test_paged_decode_attention_takes_a_sliding_window(window: int) -> None:
    """Each row attends to its last ``window`` keys (chunks cut at the window's first key, by position
    as without one); the blocks before the window are never read: here they are freed (-1)."""
    torch.manual_seed(2)
    k_cache, v_cache = torch.randn(2, 80, 16, 2, 64).half()
    tables = torch.randperm(80).to(torch.int32).reshape(2, 40)
    lens = torch.tensor([640, 129], dtype=torch.int32)
    q = torch.randn(2, 6, 64)
    ref = kernels.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125, window)
    full = kernels.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.equal(ref[1], full[1]) == (window >= 129)  # the reference does apply the window
    for row, length in enumerate(lens.tolist()):
        tables[row, : max(0, length - window) // 16] = -1
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, window)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_rms_norm_matches_reference() -> None:
    x, weight = torch.randn(5, 576) * 3, torch.randn(576)
    torch.testing.assert_close(
        kernels.rms_norm(x, weight, 1e-5), kernels.rms_norm_ref(x, weight, 1e-5), rtol=1e-5, atol=1e-5
    )


def test_silu_mul_matches_reference() -> None:
    gate_up = torch.randn(3, 2 * 200) * 6
    gate, up = gate_up.chunk(2, dim=-1)  # side by side, as the stacked projection gives them
    torch.testing.assert_close(
        kernels.silu_mul(gate, up), kernels.silu_mul_ref(gate, up), rtol=1e-6, atol=1e-6
    )
    extreme = torch.tensor([[-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0, 1e-30]])
    torch.testing.assert_close(kernels.silu_mul(extreme, extreme), kernels.silu_mul_ref(extreme, extreme))


def test_gelu_tanh_mul_matches_reference() -> None:
    """Gemma's GeGLU: rows wider than a vector and not a multiple of it (the scalar tail), and the tails of
    the curve, where tanh GELU nears 0 and g."""
    gate_up = torch.randn(3, 2 * 203) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(
        kernels.gelu_tanh_mul(gate, up), kernels.gelu_tanh_mul_ref(gate, up), rtol=1e-5, atol=1e-6
    )
    extreme = torch.tensor([[-200.0, -90.0, -20.0, -3.0, 0.0, 3.0, 20.0, 90.0, 200.0, 1e-30]])
    ones = torch.ones_like(extreme)
    torch.testing.assert_close(kernels.gelu_tanh_mul(extreme, ones), kernels.gelu_tanh_mul_ref(extreme, ones))


def fast_tiny_model(attention_bias: bool) -> LlamaForCausalLM:
    """The tiny Llama with int4 linears on the C kernels, as the fast path packs the default model."""
    model, _ = make_tiny_model(attention_bias=attention_bias, hidden_size=64, intermediate_size=96)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name != "lm_head":
            model.set_submodule(name, Int4Linear.from_linear(module, group_size=32))
    install_cpu_kernels(model, CpuKernels.C_F32)
    return model


@pytest.mark.parametrize("table_kind", ["q8_0", "bf16", "float32"])
def test_a_tied_embedding_is_kept_in_the_smallest_form_that_gives_it_back_exactly(table_kind: str) -> None:
    """Where the lm_head's Q8_0 blocks give the embedding table back exactly (a GGUF's tied Q8_0
    embedding), rows are dequantized from them; where bfloat16 holds every value (a bf16 checkpoint's
    table, as an HF BitNet model's) the table is kept in bfloat16; either way the float32 table goes. A
    table neither gives back stays as it is, so the inputs never change."""
    model, _ = make_tiny_model(tie_word_embeddings=True)
    table = model.model.embed_tokens.weight
    with torch.no_grad():
        if table_kind == "q8_0":
            codes, scales = kernels.quantize_q8_0(table)
            table.copy_((codes.float().unflatten(1, (-1, 32)) * scales.float()[..., None]).flatten(1))
        elif table_kind == "bf16":
            table.copy_(table.bfloat16().float())
    expected = table.detach().clone()
    install_cpu_kernels(model, CpuKernels.C_F32)
    embedding = model.model.embed_tokens
    assert isinstance(model.lm_head, Q8CpuLinear)
    kinds = {"q8_0": Q8Embedding, "bf16": Bf16Embedding, "float32": nn.Embedding}
    assert type(embedding) is kinds[table_kind]
    assert activation_dtype(model) == torch.float32
    ids = torch.tensor([[0, 5, 258], [7, 7, 1]])
    out = embedding(ids)
    assert out.dtype == torch.float32 and torch.equal(out, expected[ids])


@pytest.mark.parametrize("attention_bias", [False, True])
def test_decoder_layer_kernel_is_the_layers_torch_path_bit_for_bit(attention_bias: bool) -> None:
    """A decode step through the one-call C layers gives exactly what the layers' torch path (the
    same kernels, op by op) gives, so the engine may mix the two from step to step."""
    assert_decoder_kernel_is_the_torch_path(fast_tiny_model(attention_bias))


def assert_decoder_kernel_is_the_torch_path(model: nn.Module) -> None:
    """Decode rows through ``model``'s one-call C layers equal its layers' torch path, bit for bit; a
    layer handed another cache is written there (tests/engine/test_ternary_models.py uses it too)."""
    layers = model.model.layers
    kernel = model.model.decode_kernel
    assert isinstance(kernel, DecoderLayersKernel) and kernel.layers == list(layers)
    attention = [layer.self_attn.attn for layer in layers]
    assert all(isinstance(attn.backend, CDecode) for attn in attention)
    block_size, kv_heads, dim = 4, attention[0].num_kv_heads, attention[0].head_dim
    cache = torch.zeros(2, len(layers), 16, block_size, kv_heads, dim, dtype=torch.float16)
    for i, attn in enumerate(attention):
        attn.k_cache, attn.v_cache = cache[0, i], cache[1, i]
    tables = [[3, 7, 1], [0], [5, 2]]
    prompts = [torch.randint(0, model.config.vocab_size, (n,)) for n in (10, 3, 6)]

    def run(sequences: list[int], ids: list[list[int]], starts: list[int]) -> Tensor:
        """New tokens ``ids[i]`` of each sequence ``sequences[i]`` from position ``starts[i]`` on."""
        positions = [start + j for new, start in zip(ids, starts, strict=True) for j in range(len(new))]
        owners = [seq for seq, new in zip(sequences, ids, strict=True) for _ in new]
        set_context(
            make_context(
                query_lens=[len(new) for new in ids],
                context_lens=[start + len(new) for new, start in zip(ids, starts, strict=True)],
                block_tables=[tables[seq] for seq in sequences],
                slot_mapping=[
                    tables[seq][p // block_size] * block_size + p % block_size
                    for seq, p in zip(owners, positions, strict=True)
                ],
            )
        )
        try:
            with torch.inference_mode():
                return model(torch.tensor([t for new in ids for t in new]), torch.tensor(positions))
        finally:
            reset_context()

    for seq, prompt in enumerate(prompts):  # prefill (the torch path)
        run([seq], [prompt.tolist()], [0])
    # one decode row per sequence, and a sequence alone
    for sequences in ([0, 1, 2], [2]):
        args = (sequences, [[7 + seq] for seq in sequences], [len(prompts[seq]) for seq in sequences])
        fused = run(*args)
        model.model.decode_kernel = None
        try:
            op_by_op = run(*args)
        finally:
            model.model.decode_kernel = kernel
        assert torch.equal(fused, op_by_op)
    # a layer handed another cache (here only the last one): the kernel writes to the new one
    last = attention[-1]
    old_k = last.k_cache
    last.k_cache, last.v_cache = old_k.clone(), last.v_cache.clone()
    before = old_k.clone()
    position = len(prompts[0]) + 1
    run([0], [[9]], [position])
    slot = tables[0][position // block_size], position % block_size
    assert torch.equal(old_k, before) and not torch.equal(last.k_cache[slot], before[slot])


def test_torch_kernels_can_be_chosen_instead() -> None:
    """``--cpu-kernels torch`` packs torch's int4/int8 linears and leaves the layers op by op."""
    model, _ = make_tiny_model(hidden_size=64, intermediate_size=96)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name != "lm_head":
            model.set_submodule(name, Int4Linear.from_linear(module, group_size=32))
    install_cpu_kernels(model, CpuKernels.TORCH_INT4_F32)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int4PackedCpuLinear)
    assert model.model.decode_kernel is None and not layer.input_layernorm.c_kernel
    assert isinstance(layer.self_attn.attn.backend, TorchDecode)
