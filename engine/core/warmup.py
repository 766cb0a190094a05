"""Warm-up at load, before the engine serves: compile the model's own kernel shapes, capture decode.

``tern engine`` binds its port only once :class:`~engine.core.llm_engine.LLMEngine` is built, and
the engine runs :func:`warm_up` while it is built (on CUDA), so ``/health`` cannot answer before
both halves are done:

1. **Compile.** A forward at each prefill M bucket (``engine/kernels/tuning.py``) and each decode
   batch size, so every (kernel, config) the tuning table picks for this model's N, K and M buckets
   is compiled now, not under the first request. Configs compile once whatever N and K are
   (they are runtime arguments), so this is a handful of compiles, and Triton's on-disk cache
   (``TRITON_CACHE_DIR``, set by ``engine/kernels``) makes a restart skip them.
2. **Capture.** The decode step as a CUDA graph per batch size of
   :func:`~engine.core.cuda_graphs.capture_sizes` (``engine/core/cuda_graphs.py``).

Warm-up steps write K/V only to the runner's scratch block, which no sequence owns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from engine.core.cuda_graphs import CudaGraphCapture, DecodeGraphs, GraphCapture, capture_sizes
from engine.layers.context import Context, reset_context, set_context

log = logging.getLogger(__name__)

Model = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class WarmupReport:
    prefill_tokens: list[int] = field(default_factory=list)
    """Token counts of the uncached forwards run (one per prefill M bucket)."""
    decode_sizes: list[int] = field(default_factory=list)
    """Decode batch sizes run (and captured, where ``graph_sizes`` has them)."""
    graph_sizes: list[int] = field(default_factory=list)
    compile_s: float = 0.0
    capture_s: float = 0.0


def prefill_buckets(max_num_batched_tokens: int) -> list[int]:
    """The GEMM launches' M buckets a prefill chunk can fall in: 32, 64, ... up to the step's limit."""
    from engine.kernels.tuning import GEMM_MAX_BUCKET  # Triton: a CPU engine never imports it

    top = min(max_num_batched_tokens, GEMM_MAX_BUCKET)
    sizes, size = [], 32
    while size <= top:
        sizes.append(size)
        size *= 2
    return sizes


def scratch_context(size: int, scratch_block: int, block_size: int, device: torch.device) -> Context:
    """A decode step of ``size`` rows that all write and read one slot of the scratch block."""
    return Context(
        is_prefill=False,
        slot_mapping=torch.full((size,), scratch_block * block_size, dtype=torch.long, device=device),
        query_lens=torch.ones(size, dtype=torch.int32, device=device),
        context_lens=torch.ones(size, dtype=torch.int32, device=device),
        block_tables=torch.full((size, 1), scratch_block, dtype=torch.int32, device=device),
        query_lens_host=[1] * size,
        context_lens_host=[1] * size,
    )


@torch.inference_mode()
def warm_up(
    model: Model,
    config: EngineConfig,
    *,
    device: torch.device,
    scratch_block: int,
    block_size: int,
    max_blocks: int,
    graph_safe: bool,
    capture: GraphCapture | None = None,
) -> tuple[WarmupReport, DecodeGraphs | None]:
    """Compile this model's shapes, then capture its decode graphs where ``graph_safe`` and
    ``config.cuda_graphs`` allow; ``capture`` defaults to CUDA's (the launch boundary)."""
    report = WarmupReport()
    start = time.perf_counter()
    for tokens in prefill_buckets(config.max_num_batched_tokens):
        model(torch.zeros(tokens, dtype=torch.long, device=device), torch.arange(tokens, device=device))
        report.prefill_tokens.append(tokens)
    report.decode_sizes = capture_sizes(config.max_num_seqs)
    for size in report.decode_sizes:
        set_context(scratch_context(size, scratch_block, block_size, device))
        try:
            model(
                torch.zeros(size, dtype=torch.long, device=device),
                torch.zeros(size, dtype=torch.long, device=device),
            )
        finally:
            reset_context()
    _synchronize(device)
    report.compile_s = time.perf_counter() - start
    graphs = None
    if graph_safe and config.cuda_graphs:
        start = time.perf_counter()
        graphs = DecodeGraphs(
            model,
            sizes=report.decode_sizes,
            max_blocks=max_blocks,
            scratch_block=scratch_block,
            block_size=block_size,
            device=device,
            capture=capture or CudaGraphCapture(),
        )
        _synchronize(device)
        report.graph_sizes = list(graphs.sizes)
        report.capture_s = time.perf_counter() - start
    log.info(
        "warm-up: %d prefill and %d decode shapes in %.1f s; %d decode graphs captured in %.1f s",
        len(report.prefill_tokens), len(report.decode_sizes), report.compile_s,
        len(report.graph_sizes), report.capture_s,
    )  # fmt: skip
    return report, graphs


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
