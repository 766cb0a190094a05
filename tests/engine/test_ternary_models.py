"""Ternary models on the ternary C kernel: TQ2_0 / TQ1_0 GGUFs (llama and bitnet architectures, written here
as llama.cpp writes them) and a transformers BitNet checkpoint load into ``TernaryCpuLinear`` without a
float copy, hold exactly the file's weights, and give the same logits and greedy tokens as the plain-torch
reference path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.cpu import kernels, ternary
from engine.layers.context import make_context, reset_context, set_context
from engine.layers.packed_linear import Bf16Embedding
from engine.layers.quant.linear import TernaryLinear
from engine.layers.ternary_linear import TernaryCpuLinear
from engine.loader import load_model
from engine.loader.linear_factory import CpuKernels, install_cpu_kernels
from tests.engine.test_bitnet_parity import eager_transformers, hf_bitnet_model  # noqa: F401
from tests.engine.test_cpu_kernels import assert_decoder_kernel_is_the_torch_path
from tests.engine.test_engine import request, run, tokens_of
from tests.engine.test_loader_gguf import (
    BYTE_TOKENS,
    add_byte_tokenizer,
    add_llama_hyperparameters,
    llama_cpp_permute,
)
from tests.engine.test_quant_checkpoint import save_dir

pytestmark = [
    pytest.mark.skipif(not kernels.available(), reason="no C compiler: the CPU kernels cannot be built"),
    pytest.mark.usefixtures("one_thread"),
]
Q = gguf.GGMLQuantizationType
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
LINEARS = {  # GGUF role -> [out, in]
    "attn_q": (HIDDEN, HIDDEN),
    "attn_k": (HIDDEN // HEADS * KV_HEADS, HIDDEN),
    "attn_v": (HIDDEN // HEADS * KV_HEADS, HIDDEN),
    "attn_output": (HIDDEN, HIDDEN),
    "ffn_gate": (FFN, HIDDEN),
    "ffn_up": (FFN, HIDDEN),
    "ffn_down": (HIDDEN, FFN),
}


def ternary_tensors(architecture: str, shared_scales: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """GGUF-named float tensors of a random model. Its linears: ternary values times one scale per tensor
    (a BitNet model, as convert_hf_to_gguf.py writes one: every block's absmax is that scale), or plain
    random floats (a float model, whose TQ2_0 blocks each get their own absmax, as llama-quantize does)."""
    rng = np.random.default_rng(seed)
    vocab = len(BYTE_TOKENS)
    tensors = {
        "token_embd.weight": rng.standard_normal((vocab, HIDDEN)).astype(np.float32),
        "output_norm.weight": rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32),
        "output.weight": (rng.standard_normal((vocab, HIDDEN)) * 0.05).astype(np.float32),
    }
    norms = {"attn_norm": HIDDEN, "ffn_norm": HIDDEN}
    if architecture == "bitnet":
        norms |= {"attn_sub_norm": HIDDEN, "ffn_sub_norm": FFN}
    for layer in range(LAYERS):
        for role, width in norms.items():
            tensors[f"blk.{layer}.{role}.weight"] = rng.uniform(0.5, 1.5, width).astype(np.float32)
        for role, shape in LINEARS.items():
            if shared_scales:
                weight = rng.integers(-1, 2, shape).astype(np.float32) * np.float32(
                    2.0 ** -rng.integers(3, 6)
                )
            else:
                weight = (rng.standard_normal(shape) * 0.05).astype(np.float32)
            if architecture == "llama" and role in ("attn_q", "attn_k"):
                weight = llama_cpp_permute(weight, HEADS if role == "attn_q" else KV_HEADS)
            tensors[f"blk.{layer}.{role}.weight"] = weight
    return tensors


def write_ternary_gguf(path: Path, architecture: str, qtype: Q, shared_scales: bool) -> Path:
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name(f"tiny ternary {architecture}")
    add_llama_hyperparameters(
        writer,
        layers=LAYERS,
        context=256,
        hidden=HIDDEN,
        ffn=FFN,
        heads=HEADS,
        kv_heads=KV_HEADS,
        vocab=len(BYTE_TOKENS),
    )
    if architecture == "bitnet":  # what convert_hf_to_gguf.py's BitnetModel adds
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(1.0)
    add_byte_tokenizer(writer)
    for name, weight in ternary_tensors(architecture, shared_scales).items():
        role = name.split(".")[-2]
        if role in LINEARS:
            writer.add_tensor(name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)
        elif role in ("token_embd", "output"):
            writer.add_tensor(name, weight.astype(np.float16))
        else:
            writer.add_tensor(name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class ReferenceTernary(nn.Module):
    """A ``TernaryCpuLinear``'s weight run by the plain-torch reference of its kernel."""

    def __init__(self, linear: TernaryCpuLinear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.linear
        rows = x.reshape(-1, linear.in_features).float()
        codes, block_scales = linear.natural_codes()
        out = ternary.matmul_tq2_ref(rows, codes, linear.row_scales, block_scales)
        return out.to(x.dtype).reshape(*x.shape[:-1], linear.out_features)


def on_reference_path(model: nn.Module) -> nn.Module:
    for name, module in list(model.named_modules()):
        if isinstance(module, TernaryCpuLinear):
            model.set_submodule(name, ReferenceTernary(module))
    return model


def greedy(model: nn.Module, ids: list[int], steps: int = 6) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens (the whole sequence recomputed each step) and the first step's logits."""
    ids, first = list(ids), None
    with torch.no_grad():
        for _ in range(steps):
            logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))
            first = logits if first is None else first
            ids.append(int(logits[-1].argmax()))
    assert first is not None
    return ids, first


@pytest.mark.parametrize(
    ("architecture", "qtype", "shared_scales"),
    [
        ("llama", Q.TQ2_0, False),
        ("llama", Q.TQ1_0, True),
        ("bitnet", Q.TQ2_0, True),
        ("bitnet", Q.TQ1_0, False),
    ],
)
def test_ternary_gguf_loads_into_the_ternary_kernel(
    tmp_path: Path, architecture: str, qtype: Q, shared_scales: bool
) -> None:
    path = write_ternary_gguf(tmp_path / f"tiny.{qtype.name}.gguf", architecture, qtype, shared_scales)
    packed = load_model(path, progress=False, keep_gguf_int4=True)
    dequantized = load_model(path, progress=False)

    linears = {n: m for n, m in packed.model.named_modules() if isinstance(m, TernaryCpuLinear)}
    assert len(linears) == 7 * LAYERS
    assert type(packed.model).__name__ == (
        "BitNetForCausalLM" if architecture == "bitnet" else "LlamaForCausalLM"
    )
    for name, linear in linears.items():
        # the file's own codes and scales (llama's q/k rows put back in HF's order), at 2 bits a weight
        assert torch.equal(linear.dequantized_weight(), dequantized.model.get_submodule(name).weight)
        # a row of one block trivially shares its scale
        assert (linear.row_scales is not None) == (shared_scales or linear.in_features == ternary.QK)
        assert linear.bits_per_weight() <= 2 + max(16 / 256, 32 / linear.in_features)
    assert not any(type(m) is nn.Linear and "layers" in n for n, m in packed.model.named_modules())

    prompt = [3, 70, 101, 200, 12, 256, 9]
    tokens, logits = greedy(packed.model, prompt)
    reference_tokens, reference_logits = greedy(on_reference_path(packed.model), prompt)
    assert torch.equal(logits, reference_logits)
    assert tokens == reference_tokens


@pytest.fixture
def bitnet_dir(
    hf_tokenizer_dir: Path,
    tmp_path: Path,
    eager_transformers: None,  # noqa: F811
) -> tuple[Path, Any]:
    """A packed transformers BitNet checkpoint of a small random model, and that model."""
    hf_model = hf_bitnet_model()
    config: Any = hf_model.config
    config.architectures = ["BitNetForCausalLM"]
    config.quantization_config = {
        "quant_method": "bitnet",
        "linear_class": "bitlinear",
        "quantization_mode": "offline",
    }
    return save_dir(tmp_path / "bitnet", config, dict(hf_model.state_dict()), hf_tokenizer_dir), hf_model


@torch.no_grad()
def test_hf_bitnet_checkpoint_on_the_ternary_kernel_keeps_its_greedy_tokens(
    bitnet_dir: tuple[Path, Any],
) -> None:
    path, hf_model = bitnet_dir
    reference = load_model(path, "cpu", torch.float32, progress=False)
    fast = load_model(path, "cpu", torch.float32, progress=False, keep_gguf_int4=True)  # the fast path's load
    assert sum(isinstance(m, TernaryLinear) for m in reference.model.modules()) == 7 * 2
    assert sum(isinstance(m, TernaryCpuLinear) for m in fast.model.modules()) == 7 * 2

    prompt = [1, 20, 30, 42, 7, 9, 12]
    tokens, logits = greedy(fast.model, prompt, steps=8)
    reference_tokens, reference_logits = greedy(reference.model, prompt, steps=8)
    assert torch.equal(logits, reference_logits)  # the torch path's arithmetic, bit for bit
    assert tokens == reference_tokens
    # and what transformers' BitNet computes, to float rounding
    torch.testing.assert_close(logits, hf_model(torch.tensor(prompt)[None]).logits[0], rtol=1e-4, atol=1e-5)
    # a TernaryLinear (say a float checkpoint ternarized with --quant bitnet) converts to the same
    for name, module in list(reference.model.named_modules()):
        if isinstance(module, TernaryLinear):
            reference.model.set_submodule(name, TernaryCpuLinear.from_linear(module))
    assert torch.equal(greedy(reference.model, prompt, steps=1)[1], logits)


def test_the_engine_serves_a_bitnet_checkpoint_on_the_ternary_kernel_by_default(
    bitnet_dir: tuple[Path, Any],
) -> None:
    """``tern engine --model <bitnet dir>`` with its defaults: every ternary linear on the C kernel
    (q/k/v stacked), and the greedy tokens of the exact path (``--dtype float32``: TernaryLinear)."""
    path = str(bitnet_dir[0])
    settings: dict[str, Any] = dict(model=path, device="cpu", num_kv_blocks=32, block_size=4, num_threads=1)
    fast = LLMEngine.from_config(EngineConfig(**settings))
    attention = fast.runner.model.model.layers[0].self_attn
    assert isinstance(attention.qkv_proj, TernaryCpuLinear) and isinstance(attention.o_proj, TernaryCpuLinear)
    exact = LLMEngine.from_config(EngineConfig(**settings, dtype="float32"))
    assert isinstance(exact.runner.model.model.layers[0].self_attn.q_proj, TernaryLinear)
    prompts = [[1, 20, 30, 42, 7, 9, 12], [5, 6, 7]]
    outputs = [
        {
            i: tokens_of(run(engine, request(str(i), p, max_tokens=8, ignore_eos=True))[str(i)])
            for i, p in enumerate(prompts)
        }
        for engine in (fast, exact)
    ]
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize(("architecture", "qtype"), [("llama", Q.TQ2_0), ("bitnet", Q.TQ1_0)])
def test_a_decode_step_in_one_c_call_is_the_torch_path_bit_for_bit(
    tmp_path: Path, architecture: str, qtype: Q
) -> None:
    """The fast path's one-call C decoder layers take ternary linears (and a BitNet layer's sub-norms and
    activation): the same rows as the layers' torch path, so steps may take either."""
    path = write_ternary_gguf(tmp_path / f"tiny.{qtype.name}.gguf", architecture, qtype, shared_scales=False)
    model = load_model(path, progress=False, keep_gguf_int4=True).model
    assert install_cpu_kernels(model, CpuKernels.C_F32).steps_in_c
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, TernaryCpuLinear)
    assert isinstance(layer.mlp.gate_up_proj, TernaryCpuLinear)
    assert_decoder_kernel_is_the_torch_path(model)


def test_a_bitnet_checkpoints_layers_run_in_one_c_call_with_squared_relu(
    bitnet_dir: tuple[Path, Any],
) -> None:
    model = load_model(bitnet_dir[0], "cpu", torch.float32, progress=False, keep_gguf_int4=True).model
    assert model.model.layers[0].mlp.relu2
    assert install_cpu_kernels(model, CpuKernels.C_F32).steps_in_c
    assert_decoder_kernel_is_the_torch_path(model)


def test_the_engine_serves_a_tq2_0_gguf_on_the_ternary_kernel_by_default(tmp_path: Path) -> None:
    """``tern engine --model <TQ2_0 GGUF>`` with its defaults: ternary linears, decode steps in one C call."""
    path = write_ternary_gguf(tmp_path / "tiny.TQ2_0.gguf", "llama", Q.TQ2_0, shared_scales=False)
    engine = LLMEngine.from_config(
        EngineConfig(model=str(path), device="cpu", num_kv_blocks=32, num_threads=1)
    )
    model = engine.runner.model
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, TernaryCpuLinear)
    assert model.model.decode_kernel is not None and engine.steps_in_c
    assert len(tokens_of(run(engine, request("a", [3, 70, 101], max_tokens=4, ignore_eos=True))["a"])) == 4


@torch.no_grad()
def test_the_bitnet_benchmark_generators_checkpoint_loads_into_the_ternary_kernel(tmp_path: Path) -> None:
    """``bench.engine.make_bitnet_hf`` (2B-4T's layout: bfloat16 one-element ``weight_scale``,
    ``autobitlinear``, bfloat16 embeddings and norms) at a small width: every linear on the C kernel,
    the torch path's logits bit for bit and its greedy tokens."""
    from bench.engine.make_bitnet_hf import write_bitnet_hf

    path = write_bitnet_hf(tmp_path / "bitnet", layers=2, hidden=320, ffn=512)
    fast = load_model(path, "cpu", torch.float32, progress=False, keep_gguf_int4=True)
    reference = load_model(path, "cpu", torch.float32, progress=False)
    assert sum(isinstance(m, TernaryCpuLinear) for m in fast.model.modules()) == 7 * 2
    assert sum(isinstance(m, TernaryLinear) for m in reference.model.modules()) == 7 * 2
    prompt = [1, 20, 30, 42, 7, 9, 12]
    tokens, logits = greedy(fast.model, prompt)
    reference_tokens, reference_logits = greedy(reference.model, prompt)
    assert torch.equal(logits, reference_logits)
    assert tokens == reference_tokens
    # On the C kernels the head runs Q8_0 and the bfloat16 table stays bfloat16 (not a float32 copy
    # beside the head's blocks: 503 MB at 2B-4T's size), every row as the reference looks it up.
    install_cpu_kernels(fast.model, CpuKernels.C_F32)
    embedding = fast.model.model.embed_tokens
    assert isinstance(embedding, Bf16Embedding) and embedding.table.dtype == torch.bfloat16
    ids = torch.tensor(prompt)
    assert torch.equal(embedding(ids), reference.model.model.embed_tokens(ids))


def test_the_one_region_ternary_stack_is_the_same_at_any_thread_count_and_batch(tmp_path: Path) -> None:
    """A stack of ternary layers runs in one OpenMP region (ternary_stack.c, ternary_layers): at two threads
    too, and with contexts of several attention chunks (128 keys each), every row is the layers' torch
    path's at one thread and the same alone as in a batch."""
    path = write_ternary_gguf(tmp_path / "tiny.TQ2_0.gguf", "llama", Q.TQ2_0, shared_scales=False)
    model: Any = load_model(path, progress=False, keep_gguf_int4=True).model
    assert install_cpu_kernels(model, CpuKernels.C_F32).steps_in_c
    layers, kernel = model.model.layers, model.model.decode_kernel
    block_size, blocks = 16, 48
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(2, len(layers), blocks, block_size, KV_HEADS, HIDDEN // HEADS, generator=generator)
    for i, layer in enumerate(layers):
        layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache = cache[0, i].half(), cache[1, i].half()
    tables = [list(range(0, 16)), [16], list(range(17, 27))]
    lengths = [200, 5, 140]  # the new token's position is length - 1

    def step(sequences: list[int], threads: int, fused: bool) -> torch.Tensor:
        set_context(
            make_context(
                query_lens=[1] * len(sequences),
                context_lens=[lengths[s] for s in sequences],
                block_tables=[tables[s] for s in sequences],
                slot_mapping=[
                    tables[s][(lengths[s] - 1) // block_size] * block_size + (lengths[s] - 1) % block_size
                    for s in sequences
                ],
            )
        )
        model.model.decode_kernel = kernel if fused else None
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.inference_mode():
                ids = torch.tensor([7 + s for s in sequences])
                return model(ids, torch.tensor([lengths[s] - 1 for s in sequences]))
        finally:
            torch.set_num_threads(before)
            model.model.decode_kernel = kernel
            reset_context()

    reference = step([0, 1, 2], threads=1, fused=False)
    for threads in (1, 2):
        assert torch.equal(step([0, 1, 2], threads, fused=True), reference)
        assert torch.equal(step([2], threads, fused=True), reference[2:])
