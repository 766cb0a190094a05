"""Building and loading the C kernels of ``engine/cpu``: compiled with the machine's C compiler on
first use (``-march=native``), cached under ``$TERN_KERNEL_CACHE`` (default ``~/.cache/tern/kernels``),
keyed by the sources, the flags and the CPU's features, and loaded with ctypes. With no C compiler,
:func:`library` returns None and the engine keeps torch's kernels. The wrappers that call the
kernels are ``kernels.py``, ``ggml_kernels.py`` and ``ternary.py``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "quant_rows.c",
        "quant_kernels.c",
        "q4_1_tiled_kernels.c",
        "kquant_kernels.c",
        "q8k_rows.c",
        "kquant_tiled_kernels.c",
        "kquant_tiled_avx2.c",
        "q6_k_tiled_kernels.c",
        "q6_k_tiled_avx2.c",
        "q8_0_rows.c",
        "q8_0_tiled_kernels.c",
        "q8_0_tiled_avx2.c",
        "q8_0_head_tiles.c",
        "attention_kernels.c",
        "layer_rows.c",
        "layer_kernels.c",
        "gated_rows.c",
        "ternary_stack.c",
        "ternary_kernels.c",
        "ternary_activations.c",
        "ternary_row_avx2.c",
    )
)
INCLUDES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "paged_attention.inc",
        "kernels.h",
        "quant_rows.h",
        "layer_rows.h",
        "decoder_layer.h",
        "row_codes_avx2.h",
    )
)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")
VNNI_ENV = "TERN_CPU_VNNI"
"""Set to 0 to build q4_1 with the AVX-512 tiles where the CPU has AVX-512 VNNI, whose own kernel
(weights tile by tile, ``tiled_q4_1`` in q4_1_tiled_kernels.c) is otherwise the one built: to compare the
two on one machine (docs/engine.md, "The VNNI q4_1 kernel")."""
AVX512_ENV = "TERN_CPU_AVX512"
"""Set to 0 to build the kernels with no AVX-512 at all where the CPU has it: ``-mno-avx512f`` turns off
every AVX-512 extension (the compiler emits no zmm register, nor an EVEX-only instruction) while the
rest of ``-march=native`` stays (AVX2, FMA, F16C, and AVX-VNNI where the CPU has it), and
``TERN_NO_AVX512`` (kernels.h) picks the AVX2 code: the AVX2 CPUs' kernels (AMD Zen 2/3, Intel client
parts), which the tests run in a second process on a machine with AVX-512."""

ONE_REGION_ENV = "TERN_CPU_ONE_REGION"
"""Set to 0 to build the decode stack of ternary layers with a parallel region a kernel call
(``TERN_NO_ONE_REGION`` in ternary_stack.c) instead of one for the whole stack: to compare the two."""


def _flags() -> tuple[str, ...]:
    flags = FLAGS + (("-DTERN_NO_Q4_VNNI",) if os.environ.get(VNNI_ENV) == "0" else ())
    flags += ("-DTERN_NO_ONE_REGION",) if os.environ.get(ONE_REGION_ENV) == "0" else ()
    return flags + (("-mno-avx512f", "-DTERN_NO_AVX512") if os.environ.get(AVX512_ENV) == "0" else ())


class KernelError(RuntimeError):
    pass


def _cpu_signature() -> str:
    try:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


def _cache_dir() -> Path:
    root = os.environ.get("TERN_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tern", "kernels"
    )
    return Path(root)


def _build(compiler: str) -> Path:
    source = b"".join(path.read_bytes() for path in SOURCES + INCLUDES)
    flags = _flags()
    key = hashlib.sha256(source + " ".join(flags).encode() + _cpu_signature().encode()).hexdigest()[:16]
    target = _cache_dir() / f"tern_cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: two engines starting at once never load a half-written file.
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", str(partial), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        partial.replace(target)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        partial.unlink(missing_ok=True)
        detail = getattr(exc, "stderr", "") or str(exc)
        raise KernelError(f"building the CPU kernels failed: {detail.strip()[:2000]}") from exc
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot be built (no C compiler, not x86/ARM Linux)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: the CPU quantized kernels are off (torch's kernels serve)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (KernelError, OSError) as exc:
        log.warning("the CPU quantized kernels are off: %s", exc)
        return None
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.tern_matmul_q4_1.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr]
    lib.tern_matmul_q8_0.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr]
    lib.tern_q4_1_tiled.argtypes = []
    lib.tern_quantize_rows.argtypes = [ptr, i64, i64, ptr, ptr, ptr]
    lib.tern_quantize_rows.restype = None
    # q, k_cache, v_cache, half, block_tables, width, context_lens, B, H, KVH, D, block_size, scale, out
    lib.tern_paged_decode_attention.argtypes = [ptr, ptr, ptr, ctypes.c_int, ptr, i64, ptr, i64]
    lib.tern_paged_decode_attention.argtypes += [i64, i64, i64, i64, i64, f32, ptr]
    lib.tern_rms_norm.argtypes = [ptr, ptr, i64, i64, f32, ptr]
    lib.tern_rms_norm.restype = None
    lib.tern_silu_mul.argtypes = [ptr, ptr, i64, i64, i64, ptr]
    lib.tern_silu_mul.restype = None
    lib.tern_gelu_tanh_mul.argtypes = [ptr, ptr, i64, i64, i64, ptr]
    lib.tern_gelu_tanh_mul.restype = None
    # layers, count, hidden, M, E, step (a TernDecodeStep), out
    lib.tern_decoder_layers.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr]
    return lib


def available() -> bool:
    return library() is not None


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise KernelError("the CPU quantized kernels are not available on this machine")
    return lib
