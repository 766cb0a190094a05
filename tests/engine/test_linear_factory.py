"""The fast-path policy (engine/loader/serving.py) and the linear factory's table
(engine/loader/linear_factory.py): which kernel set a config gets, and what each format maps to."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.cpu import kernels as cpu_kernels
from engine.layers.packed_linear import Int8PackedCpuLinear, MklPackedLinear, Q4CpuLinear
from engine.layers.quant.linear import Int4Linear, TernaryLinear
from engine.loader.linear_factory import (
    LINEAR_KERNELS,
    CpuKernels,
    WeightFormat,
    install_cpu_kernels,
    weight_format,
)
from engine.loader.serving import ServingPlan, serving_plan
from tests.engine.tiny_engine import make_tiny_model

CPU = torch.device("cpu")
C_OR_TORCH = CpuKernels.C_F32 if cpu_kernels.available() else CpuKernels.TORCH_INT4_F32


@pytest.mark.parametrize(
    ("config", "device", "dtype", "plan"),
    [
        # on the C kernels a GGUF's other GGML types stay in their own blocks too (engine/cpu/ggml_kernels.py)
        (EngineConfig(), CPU, torch.float32, ServingPlan(True, C_OR_TORCH, C_OR_TORCH is CpuKernels.C_F32)),
        (EngineConfig(cpu_kernels="torch"), CPU, torch.float32, ServingPlan(True, CpuKernels.TORCH_INT4_F32)),
        (EngineConfig(dtype="float32"), CPU, torch.float32, ServingPlan(False, CpuKernels.MKL_F32)),
        (EngineConfig(dtype="bfloat16"), CPU, torch.bfloat16, ServingPlan(True, CpuKernels.ONEDNN_BF16)),
        (EngineConfig(dtype="float16"), CPU, torch.float16, ServingPlan(False, None)),
        (EngineConfig(pack_cpu_linears=False), CPU, torch.float32, ServingPlan(False, None)),
        (EngineConfig(), torch.device("cuda"), torch.bfloat16, ServingPlan(False, None)),
    ],
    ids=["auto", "torch-kernels", "exact", "bf16", "fp16", "no-pack", "cuda"],
)
def test_the_plan_follows_the_config(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, plan: ServingPlan
) -> None:
    assert serving_plan(config, device, dtype) == plan


def test_formats_are_found_by_exact_type() -> None:
    linear = nn.Linear(64, 32)
    assert weight_format(linear) is WeightFormat.FLOAT
    assert weight_format(Int4Linear.from_linear(linear, group_size=32)) is WeightFormat.INT4
    assert weight_format(TernaryLinear.from_linear(linear)) is WeightFormat.TERNARY
    assert weight_format(MklPackedLinear(linear)) is None  # already packed: not packed twice
    for rows in LINEAR_KERNELS.values():
        for candidates in rows.values():
            assert candidates and all(callable(getattr(c, "supports", None)) for c in candidates)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler: the CPU kernels cannot be built")
def test_the_first_candidate_that_supports_a_module_takes_it() -> None:
    """On the C kernel set a linear whose K is not whole Q8_0 blocks falls to the next candidate."""
    model, _ = make_tiny_model(hidden_size=64, intermediate_size=96)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name != "lm_head":
            model.set_submodule(name, Int4Linear.from_linear(module, group_size=32))
    model.lm_head = nn.Linear(48, model.config.vocab_size, bias=False)  # K = 48: not whole blocks of 32
    installed = install_cpu_kernels(model, CpuKernels.C_F32)
    assert isinstance(model.lm_head, Int8PackedCpuLinear)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, Q4CpuLinear)  # fused, then packed
    assert installed.replaced == 2 * 4 + 1 and installed.steps_in_c
