"""The GPU check script's CPU-side parts (issue 50): the script parses, and the targets read right."""

import subprocess
from pathlib import Path

from bench.engine.cuda_check import targets

SCRIPT = Path(__file__).parents[2] / "bench" / "engine" / "cuda_check.sh"


def test_the_script_parses_and_names_what_it_needs_carried() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    text = SCRIPT.read_text()
    assert "tokenizer.gguf" in text and "wheels" in text and "--prepare" in text


def _engine(quant: str, tps_1: float, tps_64: float, hbm: float | None = None) -> dict:
    one: dict = {"output_tokens_per_s": tps_1, **({"hbm_fraction": hbm} if hbm is not None else {})}
    return {"quant": quant, "streams_1": one, "streams_64": {"output_tokens_per_s": tps_64}}


def test_targets_from_cuda_serving_json() -> None:
    serving = {"engines": [_engine("int4", 200, 2500, 0.45), _engine("bitnet", 290, 3000),
                           _engine("none", 100, 900)]}  # fmt: skip
    out = targets(serving)
    assert out["int4_b1_hbm_fraction"] == {"value": 0.45, "target": 0.40, "met": True}
    assert out["ternary_over_bf16_b1"] == {"value": 2.9, "target": 3.0, "met": False}
    assert out["int4_64_over_1_streams"] == {"value": 12.5, "target": 10.0, "met": True}


def test_targets_not_measured_are_none() -> None:
    out = targets({"engines": [{"quant": "int4", "error": "RuntimeError()"}, _engine("none", 100, 900)]})
    assert all(v["value"] is None and v["met"] is None for v in out.values())
