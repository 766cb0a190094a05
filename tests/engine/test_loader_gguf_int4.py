"""GGUF Q4_0/Q4_1 linears loaded straight into ``Int4Linear`` (``--quant int4``), never through float.

The packed layer holds the file's own codes, scales and mins, so the model computes with the same
weights as the default path that dequantizes them: logits agree to float rounding. Checked on tiny
synthetic GGUFs (every tensor type, llama's permuted q/k rows, Qwen2's biases) and the real default model.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from engine.layers.quant import Int4Linear
from engine.loader import LoadedModel, load_model
from tests.engine.test_loader_gguf import TENSOR_TYPES, gguf_name, tiny_gguf  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
Q = gguf.GGMLQuantizationType


def forward_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(len(ids))))


def assert_same_model(packed: LoadedModel, dequantized: LoadedModel, ids: list[int]) -> None:
    """Every Int4Linear holds exactly the dense weight the default path loads; logits agree."""
    for name, module in packed.model.named_modules():
        if isinstance(module, Int4Linear):
            dense = dequantized.model.get_submodule(name).weight
            torch.testing.assert_close(module.dequantized_weight(torch.float32), dense, rtol=1e-6, atol=1e-6)
    expected = forward_logits(dequantized, ids)
    torch.testing.assert_close(forward_logits(packed, ids), expected, rtol=1e-5, atol=1e-5)


def test_q4_linears_of_a_synthetic_gguf_load_packed(tiny_gguf: tuple[Path, dict[str, np.ndarray]]) -> None:  # noqa: F811
    path, original = tiny_gguf
    dequantized = load_model(path, progress=False)
    packed = load_model(path, progress=False, quant="int4")

    q4_modules = {
        name.removesuffix(".weight")
        for name in original
        if name.endswith("_proj.weight") and TENSOR_TYPES[gguf_name(name).split(".")[-2]] in (Q.Q4_0, Q.Q4_1)
    }
    int4 = {name: m for name, m in packed.model.named_modules() if isinstance(m, Int4Linear)}
    assert set(int4) == q4_modules and q4_modules  # q, k (permuted rows in llama), gate, up
    assert {m.group_size for m in int4.values()} == {32}
    # Other types (Q8_0, F16, BF16) stay dense linears with the dequantized weights.
    dense = {name for name, m in packed.model.named_modules() if type(m) is nn.Linear}
    assert "model.layers.0.self_attn.v_proj" in dense and "model.layers.0.mlp.down_proj" in dense
    assert not any(isinstance(m, Int4Linear) for m in dequantized.model.modules())  # auto: dequantize
    assert_same_model(packed, dequantized, [3, 70, 101, 200, 12, 256, 9])


@pytest.mark.slow
def test_default_model_q4_1_linears_load_packed(default_model: LoadedModel) -> None:
    packed = load_model(default_model.path, "cpu", torch.float32, progress=False, quant="int4")
    int4 = [m for m in packed.model.modules() if isinstance(m, Int4Linear)]
    assert len(int4) == 7 * default_model.config.num_hidden_layers  # every decoder linear is Q4_1
    ids = default_model.tokenizer.encode("The capital of France is Paris, and the capital of Germany is")
    assert_same_model(packed, default_model, ids)
