"""The CPU fast path (the GGUF's 4-bit weights kept as they are, packed linears; bfloat16 on a CPU with
native bf16, float32 activations elsewhere): each kernel against a plain-torch reference, and the
default model served on it against the exact float32 path (quality, Paris, batch independence,
prefix cache on = off). Whichever variant this machine runs by default is the one tested."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bench.engine.int4_quality import perplexity
from engine.config import EngineConfig, cpu_has_native_bf16
from engine.core.llm_engine import LLMEngine
from engine.layers.attention_backends import CDecode, TorchDecode
from engine.layers.ggml_linear import GgmlEmbedding, GgmlLinear
from engine.layers.packed_linear import (
    Int4PackedCpuLinear,
    Int8PackedCpuLinear,
    OneDnnPackedLinear,
    Q4CpuLinear,
    onednn_packing_available,
)
from engine.layers.quant.linear import Int4Linear
from engine.layers.stacking import stack_linears
from engine.loader.linear_factory import install_cpu_kernels
from engine.loader.load import LoadedModel
from engine.loader.serving import serving_plan
from engine.serving.frames import generate_frames
from protocol.rpc import ChatMessage, GenerateRequest, SamplingParams
from tests.engine.conftest import evaluation_ids
from tests.engine.test_engine import PROMPTS

NATIVE_BF16 = onednn_packing_available() and cpu_has_native_bf16()
needs_native_bf16 = pytest.mark.skipif(
    not NATIVE_BF16, reason="oneDNN's bf16 linears need a CPU with native bf16 (AVX512-BF16 or AMX)"
)
DEFAULT_ON_TORCH_BF16 = NATIVE_BF16 and EngineConfig(device="cpu").cpu_bf16_kernels()
"""The default config computes in bf16 on torch's kernels: native bf16 and no C compiler."""

# Measured: 18.924 against 18.907 in float32 (+0.09%, AMD EPYC); the bar is 1%.
MAX_PERPLEXITY_CHANGE = 0.01


def bf16_error_bound(reference: torch.Tensor) -> float:
    """bf16 keeps 8 significant bits: outputs may move by a few units in the last place of the largest."""
    return 4 * reference.abs().max().item() * 2**-8


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 7, 16, 100])
def test_int4_kernel_matches_the_dequantized_reference(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(256, 96, bias=bias)
    int4 = Int4Linear.from_linear(linear, group_size=32)
    x = torch.randn(rows, 256)
    reference = F.linear(x, int4.dequantized_weight(torch.float32), int4.bias)  # plain torch, float32
    for dtype in (torch.bfloat16, torch.float32):  # a float32 model's rows are rounded to bf16 inside
        out = Int4PackedCpuLinear(int4)(x.to(dtype))
        assert out.dtype == dtype and out.shape == (rows, 96)
        assert (out.float() - reference).abs().max().item() <= bf16_error_bound(reference)


@pytest.mark.parametrize("rows", [1, 16, 100])
def test_int8_lm_head_matches_linear(rows: int) -> None:
    """Per-row int8 weights and bf16 rows: within bf16's rounding plus the int8 step of each row."""
    torch.manual_seed(rows)
    linear = nn.Linear(192, 320, bias=False)
    x = torch.randn(rows, 192)
    reference = F.linear(x, linear.weight)  # plain torch, float32
    packed = Int8PackedCpuLinear(linear)
    out = packed(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 320)
    step = linear.weight.abs().amax(dim=1) / 127  # one int8 unit, per output row
    bound = bf16_error_bound(reference) + (x.abs().sum(dim=1, keepdim=True) * step / 2)
    assert ((out - reference).abs() <= bound).all()
    assert torch.equal(packed(x[:1]), out[:1])  # a row does not depend on the batch


def test_int4_kernel_rows_do_not_depend_on_the_batch() -> None:
    int4 = Int4Linear.from_linear(nn.Linear(256, 64), group_size=64)
    packed = Int4PackedCpuLinear(int4)
    x = torch.randn(40, 256).bfloat16()
    full = packed(x)
    for rows in (1, 2, 9, 17):
        assert torch.equal(packed(x[:rows]), full[:rows])


@needs_native_bf16
@pytest.mark.parametrize("rows", [1, 16, 100])
def test_onednn_packed_linear_matches_linear(rows: int) -> None:
    linear = nn.Linear(192, 320).bfloat16()
    x = torch.randn(3, rows, 192).bfloat16()
    reference = F.linear(x.float(), linear.weight.float(), linear.bias.float())
    out = OneDnnPackedLinear(linear)(x)
    assert out.shape == (3, rows, 320)
    assert (out.float() - reference).abs().max().item() <= bf16_error_bound(reference)


@pytest.mark.parametrize("kind", ["linear", "int4"])
def test_stacked_linears_output_their_parts_side_by_side(kind: str) -> None:
    torch.manual_seed(0)
    parts: list[nn.Module] = [nn.Linear(64, n, bias=True) for n in (64, 32, 32)]
    if kind == "int4":
        parts = [Int4Linear.from_linear(p, group_size=32) for p in parts]
    x = torch.randn(5, 64)
    stacked = stack_linears(parts)
    assert stacked is not None
    torch.testing.assert_close(stacked(x), torch.cat([p(x) for p in parts], dim=-1), rtol=0, atol=1e-5)
    assert stack_linears([nn.Linear(8, 8), nn.Linear(8, 8, bias=False)]) is None


def test_the_loader_fuses_and_packs_the_default_model() -> None:
    """Through the engine's loader, as ``tern engine`` runs by default on this machine."""
    engine = fast_engine()
    model = engine.runner.model
    layer = model.model.layers[0]
    # a float32 model on the C kernels: Q4_1 linears and the file's Q8_0 blocks as the lm_head; without
    # them, on native bf16: torch's int4 kernel and a oneDNN-packed bf16 lm_head (the tied Q8_0 embedding)
    int4_type = Int4PackedCpuLinear if DEFAULT_ON_TORCH_BF16 else Q4CpuLinear
    assert isinstance(layer.self_attn.qkv_proj, int4_type)
    assert isinstance(layer.mlp.gate_up_proj, int4_type)
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "up_proj")
    assert isinstance(model.lm_head, OneDnnPackedLinear if DEFAULT_ON_TORCH_BF16 else GgmlLinear)
    # on the C kernels the tied embedding is looked up from the lm_head's Q8_0 blocks (no float table)
    assert isinstance(model.model.embed_tokens, nn.Embedding if DEFAULT_ON_TORCH_BF16 else GgmlEmbedding)
    backend = TorchDecode if DEFAULT_ON_TORCH_BF16 else CDecode
    assert isinstance(layer.self_attn.attn.backend, backend)
    assert engine.runner.kv_cache.dtype == (torch.bfloat16 if DEFAULT_ON_TORCH_BF16 else torch.float16)
    # on the C kernels, decode steps run all layers in one call (engine/models/llama_decode_kernel.py),
    # and the engine's default thread count takes every core for them
    assert (model.model.decode_kernel is None) == DEFAULT_ON_TORCH_BF16
    assert engine.steps_in_c == (not DEFAULT_ON_TORCH_BF16)
    plan = serving_plan(engine.config, engine.device, engine.dtype)
    assert plan.cpu_kernels is not None and plan.keep_gguf_int4
    assert install_cpu_kernels(model, plan.cpu_kernels).replaced == 0  # nothing left to pack


_FAST_ENGINES: dict[bool, LLMEngine] = {}


def fast_engine(prefix_cache: bool = True) -> LLMEngine:
    """The default model with the default config (one engine per setting, built once), on one thread:
    what the engine picks on a 2-core machine. With two, a kernel splits a small batch's reductions
    across threads, and 1 of 16 prompts below diverged at its 22nd token (docs/engine.md)."""
    if prefix_cache not in _FAST_ENGINES:
        config = EngineConfig(device="cpu", enable_prefix_cache=prefix_cache, num_threads=1)
        _FAST_ENGINES[prefix_cache] = LLMEngine.from_config(config)
    return _FAST_ENGINES[prefix_cache]


def chat(rid: str, prompt: str, max_tokens: int = 24) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        messages=[ChatMessage(role="user", content=prompt)],
        sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


def generated(engine: LLMEngine, *requests: GenerateRequest) -> dict[str, list[int]]:
    out = generate_frames(engine, list(requests))
    return {rid: [t for f in frames if f.type == "delta" for t in f.token_ids] for rid, frames in out.items()}


@pytest.mark.slow
def test_fast_path_perplexity_is_within_one_percent_of_float32(
    default_model: LoadedModel, float32_perplexity: float
) -> None:
    ids = evaluation_ids(default_model)
    exact = float32_perplexity
    fast = perplexity(fast_engine().runner.model, ids, default_model.config.max_position_embeddings)
    print(f"\nperplexity on {len(ids)} tokens: float32 {exact:.3f}, fast path {fast:.3f}")
    assert abs(fast / exact - 1) <= MAX_PERPLEXITY_CHANGE


@pytest.mark.slow
def test_fast_path_knows_the_capital_of_france() -> None:
    request = chat("paris", "What is the capital of France?", max_tokens=16)
    request.sampling.ignore_eos = False
    engine = fast_engine()
    text = "".join(f.text for f in generate_frames(engine, [request])["paris"] if f.type == "delta")
    assert "Paris" in text, text


@pytest.mark.slow
def test_fast_path_batch_of_16_matches_each_request_alone() -> None:
    engine = fast_engine(prefix_cache=False)
    alone = {p: generated(engine, chat("a", p))["a"] for p in PROMPTS}
    batch = generated(engine, *(chat(str(i), p) for i, p in enumerate(PROMPTS)))
    assert {p: batch[str(i)] for i, p in enumerate(PROMPTS)} == alone


@pytest.mark.slow
def test_fast_path_prefix_cache_on_equals_off() -> None:
    """Requests whose shared prefix is already in the radix cache (computed by other requests) get the
    tokens they get with the cache off. (A prompt cached whole but for its last token computes that
    token as a decode row, whose attention kernel rounds differently: see docs/engine.md.)"""
    shared = "You are a helpful assistant who answers in one short paragraph. " * 4
    cached = fast_engine(prefix_cache=True)
    generated(cached, *(chat(f"warm-{i}", shared + p, max_tokens=4) for i, p in enumerate(PROMPTS[8:10])))
    hits_before = cached.metrics.cached_prompt_tokens._value.get()
    requests = [chat(str(i), shared + p) for i, p in enumerate(PROMPTS[:8])]
    with_cache = generated(cached, *requests)
    assert cached.metrics.cached_prompt_tokens._value.get() - hits_before >= 8 * 64
    assert with_cache == generated(fast_engine(prefix_cache=False), *requests)


@pytest.mark.slow
def test_explicit_bfloat16_serves_on_any_cpu() -> None:
    """``--dtype bfloat16`` where oneDNN cannot pack bf16 (an AVX2-only CPU) used to fail at start-up;
    it serves there with the int4 kernels and plain bf16 linears (on native-bf16 CPUs: the default)."""
    engine = LLMEngine.from_config(EngineConfig(device="cpu", dtype="bfloat16", num_threads=1))
    assert isinstance(engine.runner.model.model.layers[0].mlp.gate_up_proj, Int4PackedCpuLinear)
    request = chat("bf16", "What is the capital of France?", max_tokens=16)
    request.sampling.ignore_eos = False
    text = "".join(f.text for f in generate_frames(engine, [request])["bf16"] if f.type == "delta")
    assert "Paris" in text, text
