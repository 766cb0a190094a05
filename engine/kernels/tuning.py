"""The Triton kernels' launch configs: a small, pre-decided space per kernel, and a committed table.

Nothing tunes on the request path. Each launch kind (``int4_g128_decode``, ``ternary_gemm``, ...)
has one **default** config that compiles for every shape and at most ``MAX_CONFIGS`` hand-picked
alternatives (:data:`SPACES`). Which alternative is best for a shape is measured once per GPU by
``tern bench kernel-tuning`` and committed in ``tuning_table.json``, keyed by (kernel, GPU name,
Triton version, N, K, M bucket). :func:`choose` looks the key up in a dict; a missing entry takes
the default and logs one line per key. There is no ``triton.autotune`` anywhere in the engine: an
autotuner compiles and times its whole space the first time it sees a key, which on the H200 run
(docs/benchmarks/cuda-h200-0ec37c6) was minutes of ``ptxas`` per linear shape before the first token.

N and K are runtime arguments of the kernels and M is not specialized on, so a config compiles once
per kernel (Triton may still specialize N and K on divisibility by 16: at most two variants).
Compilation cost is then bounded by the configs the model's table entries name, plus the defaults.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import triton

log = logging.getLogger(__name__)

MAX_CONFIGS = 8
"""Most alternatives a kernel's space may hold (besides its default): each one costs a compile."""

DECODE_MAX_M = 16
"""Batches up to this many rows take the split-K decode launch (one 16-row tile)."""

GEMM_MAX_BUCKET = 512
"""Prefill batches of more rows share the largest M bucket."""

TABLE_PATH = Path(__file__).with_name("tuning_table.json")
TABLE_ENV = "TERN_TUNING_TABLE"
"""Overrides :data:`TABLE_PATH` (e.g. a table ``tern bench kernel-tuning`` just wrote elsewhere)."""


@dataclass(frozen=True)
class LaunchConfig:
    """One compiled variant: the kernel's ``tl.constexpr`` block sizes plus warps and stages."""

    meta: tuple[tuple[str, int], ...]
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def of(cls, num_warps: int = 4, num_stages: int = 3, **meta: int) -> LaunchConfig:
        return cls(tuple(sorted(meta.items())), num_warps, num_stages)

    @classmethod
    def from_json(cls, data: dict[str, int]) -> LaunchConfig:
        data = dict(data)
        return cls.of(num_warps=data.pop("num_warps", 4), num_stages=data.pop("num_stages", 3), **data)

    def to_json(self) -> dict[str, int]:
        return {**dict(self.meta), "num_warps": self.num_warps, "num_stages": self.num_stages}

    def kwargs(self) -> dict[str, int]:
        """Keyword arguments of a launch: ``kernel[grid](*args, **config.kwargs())``."""
        return self.to_json()

    def __getitem__(self, name: str) -> int:
        return dict(self.meta)[name]

    @property
    def name(self) -> str:
        return "-".join(f"{k}{v}" for k, v in self.meta) + f"-w{self.num_warps}-s{self.num_stages}"


@dataclass(frozen=True)
class TuningSpace:
    kernel: str
    """The table's kernel name: one compiled kernel and launch kind."""
    default: LaunchConfig
    """Compiles for every shape; taken when the table has no entry."""
    configs: tuple[LaunchConfig, ...] = ()
    """The hand-picked alternatives ``tern bench kernel-tuning`` times (at most ``MAX_CONFIGS``)."""

    def candidates(self) -> tuple[LaunchConfig, ...]:
        """The default first, then the alternatives that differ from it."""
        return (self.default, *[c for c in self.configs if c != self.default])


def _c(warps: int, stages: int, **meta: int) -> LaunchConfig:
    return LaunchConfig.of(num_warps=warps, num_stages=stages, **meta)


def _int4_spaces(group: int) -> tuple[TuningSpace, TuningSpace]:
    """BLOCK_K is the group size: one scale and min row per tile, loaded once per iteration."""
    g = group
    decode = TuningSpace(
        f"int4_g{g}_decode",
        _c(4, 3, BLOCK_M=16, BLOCK_N=64, BLOCK_K=g, SPLIT_K=4),
        tuple(
            _c(w, s, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=g, SPLIT_K=sk)
            for bn, sk, w, s in (
                (32, 8, 4, 3),
                (64, 1, 4, 3),
                (64, 2, 4, 4),
                (64, 8, 4, 3),
                (128, 1, 4, 3),
                (128, 2, 8, 3),
                (128, 4, 8, 4),
                (256, 1, 8, 3),
            )
        ),
    )
    gemm = TuningSpace(
        f"int4_g{g}_gemm",
        _c(4, 3, BLOCK_M=64, BLOCK_N=64, BLOCK_K=g, SPLIT_K=1),
        tuple(
            _c(w, s, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=g, SPLIT_K=1)
            for bm, bn, w, s in (
                (32, 64, 4, 3),
                (64, 128, 4, 3),
                (128, 64, 4, 3),
                (128, 128, 8, 3),
                (64, 64, 4, 4),
                (128, 128, 8, 4),
                (64, 256, 8, 3),
                (128, 256, 8, 3),
            )
        ),
    )
    return decode, gemm


TERNARY_DECODE = TuningSpace(
    "ternary_decode",
    _c(4, 3, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4),
    tuple(
        _c(w, 3, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk)
        for bn, bk, sk, w in (
            (64, 256, 1, 4),
            (64, 256, 4, 4),
            (128, 128, 2, 4),
            (128, 256, 1, 8),
            (128, 256, 4, 8),
            (32, 256, 8, 4),
            (64, 128, 8, 4),
            (256, 128, 2, 8),
        )
    ),
)
TERNARY_GEMM = TuningSpace(
    "ternary_gemm",
    _c(4, 3, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1),
    tuple(
        _c(w, s, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1)
        for bm, bn, bk, w, s in (
            (32, 64, 128, 4, 3),
            (64, 128, 128, 4, 3),
            (128, 64, 128, 4, 3),
            (128, 128, 128, 8, 3),
            (64, 64, 64, 4, 4),
            (128, 128, 64, 8, 4),
            (64, 256, 128, 8, 3),
            (128, 256, 64, 8, 3),
        )
    ),
)
TERNARY_QUANTIZE = TuningSpace(
    "ternary_quantize",
    _c(4, 1, BLOCK=1024),
    (_c(2, 1, BLOCK=512), _c(8, 1, BLOCK=2048), _c(8, 1, BLOCK=4096)),
)
PAGED_DECODE = TuningSpace("paged_decode", _c(4, 2))
"""Its block sizes follow the model (head_dim, KV block, GQA group): one variant per model."""

INT4_GROUP_SIZES = (32, 64, 128)
SPACES: dict[str, TuningSpace] = {
    s.kernel: s
    for s in (
        *[space for g in INT4_GROUP_SIZES for space in _int4_spaces(g)],
        TERNARY_DECODE,
        TERNARY_GEMM,
        TERNARY_QUANTIZE,
        PAGED_DECODE,
    )
}
KERNEL_SPACES: dict[str, tuple[str, ...]] = {
    "_int4_matmul_kernel": tuple(k for k in SPACES if k.startswith("int4_")),
    "_ternary_matmul_kernel": ("ternary_decode", "ternary_gemm"),
    "_quantize_activations_kernel": ("ternary_quantize",),
    "_paged_decode_kernel": ("paged_decode",),
}
"""Each ``@triton.jit`` kernel of engine/kernels -> the spaces it launches with (tests check both ways)."""


def int4_kernel(group_size: int, decode: bool) -> str:
    return f"int4_g{group_size}_{'decode' if decode else 'gemm'}"


def m_bucket(m: int) -> int:
    """Rows -> the table's M bucket: powers of two up to ``DECODE_MAX_M`` for decode, then up to
    ``GEMM_MAX_BUCKET`` (the scheduler's decode batches are any size, so sizes share a bucket)."""
    return min(triton.next_power_of_2(max(m, 1)), GEMM_MAX_BUCKET)


TableKey = tuple[str, str, str, int, int, int]
"""(kernel, GPU name, Triton version, N, K, M bucket)."""


@dataclass
class TuningTable:
    entries: dict[TableKey, LaunchConfig] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> TuningTable:
        data = json.loads(path.read_text()) if path.exists() else {"entries": []}
        table = cls()
        for e in data.get("entries", []):
            key = (e["kernel"], e["gpu"], e["triton"], int(e["n"]), int(e["k"]), int(e["m_bucket"]))
            table.entries[key] = LaunchConfig.from_json(e["config"])
        return table

    def save(self, path: Path, about: str) -> None:
        rows = [
            {"kernel": k[0], "gpu": k[1], "triton": k[2], "n": k[3], "k": k[4], "m_bucket": k[5]}
            | {"config": cfg.to_json()}
            for k, cfg in sorted(self.entries.items())
        ]
        path.write_text(json.dumps({"about": about, "entries": rows}, indent=1) + "\n")


class Chooser:
    """The request path's config lookup: the table read once, then one dict lookup per launch."""

    def __init__(self, table: TuningTable, gpu: str, triton_version: str) -> None:
        self.table = table
        self.gpu = gpu
        self.triton_version = triton_version
        self._chosen: dict[tuple[str, int, int, int], LaunchConfig] = {}

    def choose(self, kernel: str, n: int, k: int, m: int) -> LaunchConfig:
        key = (kernel, n, k, m_bucket(m))
        config = self._chosen.get(key)
        if config is None:
            config = self._chosen[key] = self._resolve(*key)
        return config

    def _resolve(self, kernel: str, n: int, k: int, bucket: int) -> LaunchConfig:
        space = SPACES[kernel]
        entry = self.table.entries.get((kernel, self.gpu, self.triton_version, n, k, bucket))
        if entry is not None and entry in space.candidates():
            return entry
        why = "no entry" if entry is None else f"entry {entry.name} is not in the space"
        log.info(
            "kernel config %s N=%d K=%d M<=%d on %s, Triton %s: %s, using the default %s "
            "(`tern bench kernel-tuning` fills the table)",
            kernel, n, k, bucket, self.gpu, self.triton_version, why, space.default.name,
        )  # fmt: skip
        return space.default

    def chosen(self) -> dict[tuple[str, int, int, int], LaunchConfig]:
        """Every (kernel, N, K, M bucket) launched so far and its config (what warm-up compiled)."""
        return dict(self._chosen)


def device_name() -> str:
    """The table's GPU name: CUDA's device name, or ``interpreter`` in Triton's CPU interpreter."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "interpreter"


_chooser: Chooser | None = None


def chooser() -> Chooser:
    """The process's chooser over the committed table (or ``$TERN_TUNING_TABLE``), made on first use."""
    global _chooser
    if _chooser is None:
        path = Path(os.environ.get(TABLE_ENV) or TABLE_PATH)
        _chooser = Chooser(TuningTable.load(path), device_name(), triton.__version__)
    return _chooser


def set_chooser(new: Chooser | None) -> None:
    """Replace the process's chooser (None: reload from the table on next use)."""
    global _chooser
    _chooser = new
