"""RoPE frequencies and rotation against transformers' own implementation."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq

ROPE_PARAMETERS: list[dict[str, Any]] = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
]


def hf_config(params: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=512, num_attention_heads=4, rope_parameters=dict(params))


def our_scaling(params: dict[str, Any]) -> dict[str, Any] | None:
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return None if scaling["rope_type"] == "default" else scaling


@pytest.mark.parametrize("params", ROPE_PARAMETERS, ids=lambda p: p["rope_type"])
def test_inv_freq_matches_transformers(params: dict[str, Any]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = hf_config(params)
    if params["rope_type"] == "default":
        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        expected, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
        assert factor == 1.0  # no attention scaling for these types
    ours = rope_inv_freq(128, params["rope_theta"], our_scaling(params))
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


@pytest.mark.parametrize("params", ROPE_PARAMETERS, ids=lambda p: p["rope_type"])
def test_rotation_matches_transformers(params: dict[str, Any]) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    positions = torch.tensor([0, 1, 7, 300, 4095, 9000])
    q, k = torch.randn(len(positions), 4, 128), torch.randn(len(positions), 2, 128)
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config(params))(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    rope = RotaryEmbedding(128, 10000, params["rope_theta"], our_scaling(params))
    cos, sin = rope(positions, torch.float32)
    torch.testing.assert_close(apply_rotary(q, cos, sin), hf_q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rotary(k, cos, sin), hf_k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
