"""What an engine on CPU keeps resident beyond its weights and cache: no library it never uses.

The model is built on the meta device and materialised on CPU; torch's own ``to_empty`` went through
its meta-tensor references, which import sympy (32 MB resident in every engine), and the meta
device's weight initialisation imports torch._dynamo and Triton. A fresh process loads a small GGUF
on the engine's default plan, serves a request, and must not have imported them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.engine.ggml_files import MIXED_TYPES, Q, write_mixed_gguf

ROOT = Path(__file__).resolve().parents[2]
UNUSED_ON_CPU = ("sympy", "triton", "torch._dynamo")

ENGINE_RUN = """
import sys
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import EngineRequest, SamplingParams

engine = LLMEngine.from_config(EngineConfig(model=sys.argv[1], num_threads=1, speculative="off"))
params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
out = engine.generate([EngineRequest("r", [1, 2, 3, 4, 5], params)])
assert sum(len(d.token_ids) for d in out["r"].deltas) == 4
print(sorted(m for m in sys.modules if m in {unused!r}))
"""


def test_an_engine_on_cpu_imports_neither_sympy_nor_dynamo_nor_triton(tmp_path: Path) -> None:
    path = write_mixed_gguf(tmp_path / "mixed.gguf", MIXED_TYPES, Q.Q8_0, None)
    code = ENGINE_RUN.format(unused=set(UNUSED_ON_CPU))
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
