"""MKL-packed CPU linears (engine/layers/packed_linear.py): same outputs as ``nn.Linear``, and an
engine built on them keeps batch independence and the unpacked engine's greedy tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.cli import build_parser, config_from_args
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.layers.packed_linear import (
    MIN_PACKED_ROWS,
    PACKED_ROWS,
    MklPackedLinear,
    mkl_packing_available,
)
from engine.loader.linear_factory import CpuKernels, install_cpu_kernels
from tests.engine.test_engine import PROMPTS, request, run, tokens_of
from tests.engine.tiny_engine import make_byte_tokenizer, make_tiny_model

pytestmark = pytest.mark.skipif(not mkl_packing_available(), reason="this torch build has no MKL packed GEMM")


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(
    "rows", [1, MIN_PACKED_ROWS - 1, MIN_PACKED_ROWS, 11, PACKED_ROWS, PACKED_ROWS + 1, 40]
)
def test_packed_linear_matches_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 80, bias=bias)
    packed = MklPackedLinear(linear)
    assert packed.weight is linear.weight and packed.bias is linear.bias
    x = torch.randn(rows, 96)
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    # leading dimensions are kept; a non-contiguous input is fine
    x3 = torch.randn(96, rows, 1).transpose(0, 2)
    torch.testing.assert_close(packed(x3), linear(x3), rtol=1e-5, atol=1e-5)


def packed_tiny_engine(pack: bool) -> LLMEngine:
    model, config = make_tiny_model()
    if pack:
        # every decoder linear and lm_head (2 layers x 7 + 1)
        assert install_cpu_kernels(model, CpuKernels.MKL_F32).replaced == 2 * 7 + 1
    return LLMEngine(
        EngineConfig(device="cpu", block_size=4, num_kv_blocks=256, max_num_batched_tokens=32),
        model=model,
        tokenizer=make_byte_tokenizer(),
        model_config=config,
        model_name="tiny",
    )


def test_engine_on_packed_linears_is_batch_independent_and_matches_unpacked() -> None:
    """A batch of 16 decodes through the packed path (6 to 16 rows), a request alone does not."""
    packed, plain = packed_tiny_engine(True), packed_tiny_engine(False)
    assert isinstance(packed.runner.model.lm_head, MklPackedLinear)

    def batch(engine: LLMEngine) -> dict[str, list[int]]:
        frames = run(
            engine, *(request(str(i), p, max_tokens=16, ignore_eos=True) for i, p in enumerate(PROMPTS))
        )
        return {p: tokens_of(frames[str(i)]) for i, p in enumerate(PROMPTS)}

    alone = {p: tokens_of(run(packed, request("a", p, max_tokens=16, ignore_eos=True))["a"]) for p in PROMPTS}
    assert batch(packed) == alone
    assert batch(plain) == alone


def test_from_config_packs_on_cpu_float32_unless_turned_off(tiny_model_dir: Callable[[str], Path]) -> None:
    path = str(tiny_model_dir("llama3"))
    config = EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=16, num_threads=1)
    packed = LLMEngine.from_config(config)
    assert isinstance(packed.runner.model.model.layers[0].mlp.up_proj, MklPackedLinear)
    args = build_parser().parse_args(
        ["--model", path, "--device", "cpu", "--dtype", "float32", "--no-pack-cpu-linears"]
    )
    config = config_from_args(args)
    assert config.pack_cpu_linears is False
    config.num_kv_blocks = 16
    plain = LLMEngine.from_config(config)
    assert type(plain.runner.model.model.layers[0].mlp.up_proj) is nn.Linear
