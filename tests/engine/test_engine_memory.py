"""What an engine on CPU keeps resident beyond its weights and cache: no library it never uses.

The model is built on the meta device and materialised on CPU; torch's own ``to_empty`` went through
its meta-tensor references, which import sympy (32 MB resident in every engine), and the meta
device's weight initialisation imports torch._dynamo and Triton. A fresh process loads a small GGUF
on the engine's default plan, serves a request, and must not have imported them.
"""

from __future__ import annotations

import gc
import platform
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from engine.cpu import ggml_kernels
from engine.loader import load_model
from tests.engine.ggml_files import MIXED_TYPES, Q, write_mixed_gguf

ROOT = Path(__file__).resolve().parents[2]
UNUSED_ON_CPU = ("sympy", "triton", "torch._dynamo", "llguidance")

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


def test_an_engine_on_cpu_imports_no_library_a_plain_request_does_not_use(tmp_path: Path) -> None:
    """Neither sympy, torch._dynamo nor Triton; nor llguidance before a request asks for structured
    output (engine/structured/grammar.py imports it then)."""
    path = write_mixed_gguf(tmp_path / "mixed.gguf", MIXED_TYPES, Q.Q8_0, None)
    code = ENGINE_RUN.format(unused=set(UNUSED_ON_CPU))
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def _mapping_rss_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            inside = len(fields) > 5 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def _mappings_of(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of ``path`` (/proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) > 5 and fields[5] == str(path):
            start, end = (int(part, 16) for part in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def test_q5_0_linears_run_on_the_files_own_pages(tmp_path: Path) -> None:
    """Q5_0 linears run in their own blocks, tiled (or split) in place in the file's copy-on-write
    mapping: no copy (they were converted to Q8_0 blocks, 1.5x their bytes: 79 MB against 51 of the
    default model requantized to Q4_K_M). Their pages are resident in the mapping, nowhere else."""
    path = write_mixed_gguf(tmp_path / "q5_0.gguf", dict.fromkeys(MIXED_TYPES, Q.Q5_0), Q.Q8_0, None)
    tensors = [(t.tensor_type, int(t.n_bytes)) for t in gguf.GGUFReader(path).tensors]
    gc.collect()  # that reader's own mapping of the file goes
    q5_0_kib = sum(size for kind, size in tensors if kind == Q.Q5_0) // 1024
    loaded = load_model(path.resolve(), progress=False, keep_gguf_int4=True, keep_gguf_blocks=True)
    ranges = _mappings_of(path.resolve())
    for layer in loaded.model.model.layers:
        for linear in (layer.mlp.up_proj, layer.self_attn.o_proj):
            assert linear.format == ("q5_0_tiled" if ggml_kernels.tiled_isa() else "q5_0")
            for tensor in (linear.qweight, *([] if linear.scales is None else [linear.scales])):
                assert any(start <= tensor.data_ptr() < end for start, end in ranges)
    assert _mapping_rss_kib(path.resolve()) >= q5_0_kib


ARENA_RUN = """
import ctypes, sys, threading
from engine.loader.memory import release_freed_memory, use_one_malloc_arena

if sys.argv[1] == "one":
    use_one_malloc_arena()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]


def rss_anon_mb():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:")) // 1024


def burst():  # a prefill's pattern: one large buffer freed, then many smaller ones below the new threshold
    big = libc.malloc(24 << 20)
    libc.memset(big, 1, 24 << 20)
    libc.free(big)
    blocks = [libc.malloc(1 << 20) for _ in range(40)]
    for block in blocks:
        libc.memset(block, 1, 1 << 20)
    for block in blocks:
        libc.free(block)


before = rss_anon_mb()
worker = threading.Thread(target=burst)
worker.start()
worker.join()
release_freed_memory()
print(rss_anon_mb() - before)
"""


def test_what_an_engine_threads_burst_freed_goes_back_when_trimmed() -> None:
    """`tern engine` allocates from one malloc arena: malloc_trim shrinks only the main arena's top, so
    the 40 MB a thread's own arena freed at its top stayed resident (35 MB after a 2,048-token prompt,
    served) until the process exited."""
    if not platform.libc_ver()[0] == "glibc":
        pytest.skip("malloc arenas are glibc's")
    grown = subprocess.run(
        [sys.executable, "-c", ARENA_RUN, "one"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert grown.returncode == 0, grown.stderr[-2000:]
    assert int(grown.stdout.split()[-1]) < 8, grown.stdout
