"""RoPE frequencies and rotation against transformers' own implementation."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.layers.rotary import (
    MIN_TABLE_ROWS,
    RotaryEmbedding,
    apply_rotary,
    rope_attention_factor,
    rope_inv_freq,
)

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
    # YaRN: as Qwen3's long-context config, and with each of its optional parameters.
    {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768},
    {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 2048,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "truncate": False,
    },
    {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
    },
    {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 2.0,
        "original_max_position_embeddings": 4096,
        "attention_factor": 1.25,
    },
]


def hf_config(params: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    # the context YaRN's factor implies, so that transformers warns of no mismatch
    context = int(params.get("original_max_position_embeddings", 2048) * params.get("factor", 1))
    return LlamaConfig(
        hidden_size=512, num_attention_heads=4, max_position_embeddings=context, rope_parameters=dict(params)
    )


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
        assert rope_attention_factor(our_scaling(params)) == pytest.approx(factor, rel=1e-12)
        assert (factor == 1.0) == (params["rope_type"] != "yarn")  # YaRN scales cos and sin
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


def test_a_shorter_table_holds_the_longer_ones_rows() -> None:
    """Each row is computed on its own: fitting a table to fewer positions changes no value."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    rotary = RotaryEmbedding(16, 4096, 10000.0, scaling)
    positions = torch.tensor([0, 1, 63, 64, 200, 299])
    full = rotary(positions, torch.float32)
    rotary.fit(300)
    fitted = rotary(positions, torch.float32)
    assert rotary._cos_sin is not None and rotary._cos_sin.shape[0] == 300
    assert all(torch.equal(a, b) for a, b in zip(full, fitted, strict=True))
    rotary.fit(10**6)  # never past the model's positions
    assert rotary.table_positions == 4096


def test_a_cpu_table_grows_with_the_positions_run() -> None:
    """On the CPU a table holds the positions run so far (a power of two, at least MIN_TABLE_ROWS), not
    its whole fitted length (a served Gemma-3-1B held 128 MB of tables from its first request), and
    the grown table's rows are the whole one's."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    rotary = RotaryEmbedding(256, 32768, 10000.0, scaling)
    whole = rotary._table(torch.device("cpu"), rotary.table_positions)
    rotary._cos_sin = None
    for positions, rows in (([0, 5, 17], MIN_TABLE_ROWS), ([3, MIN_TABLE_ROWS, 5000], 8192), ([9], 8192)):
        cos, sin = rotary(torch.tensor(positions), torch.float32)
        assert rotary._cos_sin is not None and rotary._cos_sin.shape[0] == rows
        assert torch.equal(cos[:, 0], whole[positions, 0]) and torch.equal(sin[:, 0], whole[positions, 1])
    rotary(torch.tensor([32767]), torch.float32)
    assert rotary._cos_sin.shape[0] == 32768  # never past the fitted length
    with pytest.raises(IndexError):
        rotary(torch.tensor([32768]), torch.float32)


@pytest.mark.parametrize("architecture", ["gemma3", "phi3"])
def test_the_engine_sizes_rotary_tables_to_its_max_model_len(architecture: str, tmp_path: Any) -> None:
    """Gemma 3's two tables (global and local rope bases) and Phi-3's two (LongRoPE's short and long
    factors) hold the engine's max model length, not the model's 512 positions, and its greedy tokens
    on a sequence that runs to that length are still transformers'."""
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.loader import load_model
    from engine.serving.frames import generate_frames
    from protocol.rpc import DeltaFrame, GenerateRequest, SamplingParams
    from tests.engine.families_gguf import tiny_family_model, write_family_gguf
    from tests.engine.test_parity_hf import hf_greedy

    hf_model = tiny_family_model(architecture)
    loaded = load_model(write_family_gguf(hf_model, architecture, tmp_path / "tiny.gguf"), progress=False)
    assert loaded.config.max_position_embeddings > 96
    engine = LLMEngine(
        EngineConfig(
            device="cpu", max_model_len=96, max_num_batched_tokens=32, num_kv_blocks=16, num_threads=1
        ),
        model=loaded.model,
        tokenizer=loaded.tokenizer,
        model_config=loaded.config,
        model_name=loaded.name,
    )
    prompt = [(7 * i) % 250 + 3 for i in range(80)]  # past the window and LongRoPE's original context
    sampling = SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True)
    frames = generate_frames(engine, [GenerateRequest(request_id="r", prompt=prompt, sampling=sampling)])["r"]
    tokens = [t for f in frames if isinstance(f, DeltaFrame) for t in f.token_ids]
    assert tokens == hf_greedy(hf_model, prompt, 15)
    tables = [
        table
        for module in loaded.model.modules()
        if isinstance(module, RotaryEmbedding)
        for table in (module._cos_sin, module._long_cos_sin)
        if table is not None
    ]
    assert len(tables) == 2 and all(table.shape[0] == 96 for table in tables)
