"""Which kernel serves each GGML type on this CPU (``ggml_kernels.serving_path``): the K-quants' tiles
wherever the build has them (AVX2 and up), a type in ``CONVERTED_TO_Q8_0`` dequantized at load and run as
Q8_0, and the choice in the engine's startup log and /health (docs/engine.md, "GGUF types")."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest
from torch import nn

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.cpu import ggml_kernels, kernels
from engine.layers.ggml_linear import GgmlLinear
from engine.layers.packed_linear import Q8CpuLinear
from engine.loader import load_model
from engine.loader.linear_factory import CpuKernels, install_cpu_kernels
from engine.loader.serving import load_for_engine
from engine.serving.server import create_app
from tests.engine.ggml_files import MIXED_TYPES, Q, write_mixed_gguf

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason="no C compiler: the CPU kernels cannot be built"
)


def test_each_type_has_its_path_on_this_cpu() -> None:
    paths = ggml_kernels.serving_paths()
    tiled = ggml_kernels.tiled_isa() is not None
    assert paths["tiles_isa"] == (ggml_kernels.tiled_isa() or "none")
    for name in ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0"):
        assert paths[name] == ("tiled" if tiled else "rows")
    assert ggml_kernels.serving_path(Q.Q4_0) == "dequantized"  # its own path: Int4Linear


def test_a_type_measured_faster_as_q8_0_is_converted_at_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_mixed_gguf(tmp_path / "mixed.gguf", MIXED_TYPES, Q.Q6_K, None)
    converted = frozenset({(ggml_kernels.tiled_isa(), Q.Q6_K)})
    monkeypatch.setattr(ggml_kernels, "CONVERTED_TO_Q8_0", converted)
    assert ggml_kernels.serving_path(Q.Q6_K) == "q8_0"
    model = load_model(path, progress=False, keep_gguf_int4=True, keep_gguf_blocks=True).model
    layer = model.model.layers[0]
    assert type(layer.self_attn.v_proj) is nn.Linear  # Q6_K: dequantized, not kept as blocks
    assert isinstance(layer.self_attn.q_proj, GgmlLinear)  # Q4_K: its own blocks
    install_cpu_kernels(model, CpuKernels.C_F32)
    assert isinstance(layer.self_attn.v_proj, Q8CpuLinear)  # served as Q8_0


def test_the_paths_are_in_the_startup_log_and_health(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_mixed_gguf(tmp_path / "mixed.gguf", MIXED_TYPES, Q.Q6_K, None)
    config = EngineConfig(model=str(path), device="cpu", num_kv_blocks=16, num_threads=1)
    with caplog.at_level(logging.INFO, logger="engine.loader.serving"):
        loaded = load_for_engine(config)
    assert loaded.kernel_paths == ggml_kernels.serving_paths()
    expected_line = f"Q4_K {ggml_kernels.serving_path(Q.Q4_K)}"
    assert any(expected_line in record.getMessage() for record in caplog.records)
    engine = LLMEngine.from_loaded(config, loaded)
    transport = httpx.ASGITransport(app=create_app(engine))

    async def health() -> dict[str, object]:
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            return (await client.get("/health")).json()

    assert asyncio.run(health()) == {"status": "ok", "kernels": ggml_kernels.serving_paths()}
