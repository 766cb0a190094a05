"""The build plan (engine/loader/build_plan.py): every module's form decided from the config and the
serving plan's kernel set before any weight is read, and put on the modules as the model is built."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.cpu import kernels as cpu_kernels
from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention
from engine.layers.attention_backends import CDecode, TorchDecode, TritonDecode
from engine.layers.norm import RMSNorm
from engine.layers.quant.linear import Int4Linear
from engine.loader import gguf_file
from engine.loader.build_plan import (
    CpuKernels,
    DecodeBackendKind,
    OpForm,
    RopeVariant,
    apply_forms,
    build_plan,
)
from engine.loader.linear_factory import install_cpu_kernels
from engine.loader.load import load_model
from engine.loader.plan import KeepPolicy, TensorPlan, gguf_plan, holds_packed_blocks
from engine.loader.serving import load_for_engine
from engine.model_config import ModelConfig
from engine.models.llama import LlamaAttention, LlamaForCausalLM
from tests.engine import tiny_engine
from tests.engine.ggml_files import HEADS, KV_HEADS, MIXED_TYPES, Q, write_mixed_gguf

CPU = torch.device("cpu")


def tiny_config(**overrides: Any) -> ModelConfig:
    """tiny_engine's config at this file's sizes (4 layers, so per-layer forms differ)."""
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, head_dim=8)
    return tiny_engine.tiny_config(**(sizes | {"max_position_embeddings": 64} | overrides))


@pytest.mark.parametrize(
    ("device", "kernels", "op", "decode"),
    [
        (CPU, CpuKernels.C_F32, OpForm.C, DecodeBackendKind.C),
        (CPU, CpuKernels.TORCH_INT4_F32, OpForm.TORCH, DecodeBackendKind.TORCH),
        (CPU, None, OpForm.TORCH, DecodeBackendKind.TORCH),
        (torch.device("cuda"), None, OpForm.TORCH, DecodeBackendKind.TRITON),
    ],
    ids=["c-kernels", "torch-int4", "plain-cpu", "cuda"],
)
def test_the_kernel_set_and_device_decide_norms_and_decode_backend(
    device: torch.device, kernels: CpuKernels | None, op: OpForm, decode: DecodeBackendKind
) -> None:
    plan = build_plan(tiny_config(), device, kernels)
    assert plan.final_norm is op
    assert {(layer.norm, layer.activation, layer.decode) for layer in plan.layers} == {(op, op, decode)}
    assert plan.fuse_projections == (kernels is not None and kernels is not CpuKernels.MKL_F32)


def test_the_rope_variant_and_window_per_layer_follow_the_config_as_the_model_lays_them_out() -> None:
    """NoPE layers (SmolLM3), sliding layers with a local rope base (Gemma 3), partial rotary (Phi-4-mini):
    the plan says per layer what the model's constructor builds."""
    config = tiny_config(nope_layers=(3,), sliding_window=16, sliding_layers=(0, 1), rope_local_theta=100.0)
    plan = build_plan(config, CPU, None)
    ropes = [layer.rope for layer in plan.layers]
    assert ropes == [RopeVariant.LOCAL, RopeVariant.LOCAL, RopeVariant.FULL, RopeVariant.NOPE]
    assert [layer.window for layer in plan.layers] == [16, 16, None, None]
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    for layer, layer_plan in zip(model.model.layers, plan.layers, strict=True):
        attention = layer.get_submodule("self_attn")
        assert isinstance(attention, LlamaAttention)
        assert attention.rotary == (layer_plan.rope is not RopeVariant.NOPE)
        assert attention.attn.window == layer_plan.window
    assert model.model.local_layers == {i for i, p in enumerate(plan.layers) if p.rope is RopeVariant.LOCAL}
    partial = build_plan(tiny_config(rotary_dim=4), CPU, None)
    assert {layer.rope for layer in partial.layers} == {RopeVariant.PARTIAL}


def forms(model: torch.nn.Module) -> set[tuple[str, object]]:
    """Each norm's and activation's C flag and each attention layer's backend type."""
    out: set[tuple[str, object]] = set()
    for module in model.modules():
        if isinstance(module, RMSNorm | SiluAndMul):
            out.add((type(module).__name__, module.c_kernel))
        elif isinstance(module, Attention):
            out.add(("backend", type(module.backend)))
    return out


@pytest.mark.parametrize(
    ("device", "kernels", "backend", "c"),
    [
        (CPU, CpuKernels.C_F32, CDecode, True),
        (CPU, None, TorchDecode, False),
        (torch.device("cuda"), None, TritonDecode, False),
    ],
    ids=["c-kernels", "plain-cpu", "cuda"],
)
def test_the_forms_go_on_a_model_that_holds_no_data(
    device: torch.device, kernels: CpuKernels | None, backend: type, c: bool
) -> None:
    """``apply_forms`` needs only the modules: it runs on the meta model, before any weight exists."""
    config = tiny_config()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    apply_forms(model, build_plan(config, device, kernels))
    assert forms(model) == {("RMSNorm", c), ("SiluAndMul", c), ("backend", backend)}
    assert all(p.is_meta for p in model.parameters())


def test_a_plan_for_another_layer_count_is_refused() -> None:
    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_config())
    plan = build_plan(tiny_config(num_hidden_layers=2), CPU, None)
    with pytest.raises(ValueError, match="2 layers for a model of 4"):
        apply_forms(model, plan)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler: the CPU kernels cannot be built")
def test_the_engine_loads_the_default_model_in_its_final_form_in_one_call() -> None:
    """``load_for_engine`` is ``load_model`` on the serving plan: no pass runs after it, and the forms
    are the plan's (C norms, SiLU and decode attention, every layer in one C call)."""
    loaded = load_for_engine(EngineConfig())
    assert loaded.steps_in_c
    assert forms(loaded.model) == {("RMSNorm", True), ("SiluAndMul", True), ("backend", CDecode)}
    old_route = load_model(None, progress=False, keep_gguf_int4=True, keep_gguf_blocks=True)
    assert not old_route.steps_in_c
    assert forms(old_route.model) == {("RMSNorm", False), ("SiluAndMul", False), ("backend", TorchDecode)}
    # the old route (load, then every pass over the loaded model) ends in the same model, byte for byte
    assert install_cpu_kernels(old_route.model, CpuKernels.C_F32).steps_in_c
    assert module_contents(loaded.model) == module_contents(old_route.model)


def module_contents(model: torch.nn.Module) -> list[tuple[str, str, list[tuple[str, object]]]]:
    """Each module's name, type and attributes, its tensors by their bytes' digest (the forms and every
    weight, with no copy of the model held)."""

    def value(item: object) -> object:
        if isinstance(item, torch.Tensor) and item.is_meta:  # a placeholder (an empty KV cache)
            return (item.dtype, tuple(item.shape), "meta")
        if isinstance(item, torch.Tensor):
            return (
                item.dtype,
                tuple(item.shape),
                hashlib.sha256(item.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest(),
            )
        if isinstance(item, int | float | bool | str | type(None)):
            return item
        return type(item).__name__

    out = []
    for name, module in model.named_modules():
        attributes = {
            **vars(module),
            **dict(module.named_parameters(recurse=False)),
            **dict(module.named_buffers(recurse=False)),
        }
        fields = [(key, value(item)) for key, item in sorted(attributes.items()) if not key.startswith("_")]
        out.append((name, type(module).__name__, fields))
    return out


@pytest.mark.parametrize("q4", [False, True], ids=["q8_0-linears", "q4_0-linears"])
def test_whether_the_model_is_served_int4_is_decided_from_the_header(tmp_path: Path, q4: bool) -> None:
    """Under ``keep_gguf_int4`` a GGUF's Q4 linears stay packed (``Int4Linear``); a file without any
    stays float, neither quantized nor packed: the plan says which before a tensor is read."""
    linear_type = Q.Q4_0 if q4 else Q.Q8_0
    path = write_mixed_gguf(tmp_path / "m.gguf", dict.fromkeys(MIXED_TYPES, linear_type), Q.Q8_0, None)
    header_only = load_plan_of(path)
    assert holds_packed_blocks(header_only.values()) == q4
    model = load_model(path, progress=False, keep_gguf_int4=True).model
    kinds = {type(m) for name, m in model.named_modules() if name.endswith("_proj")}
    assert kinds == ({Int4Linear} if q4 else {torch.nn.Linear})


def load_plan_of(path: Path) -> dict[str, TensorPlan]:
    reader = gguf_file.open_gguf(path)
    return gguf_plan(gguf_file.headers(reader, "llama"), "llama", HEADS, KV_HEADS, KeepPolicy(int4=True))
