"""Owns the model and its KV-cache pool; runs one scheduled step and samples.

It sizes the pool from the memory budget and hands each attention layer its slice
of the pool. A step is :meth:`ModelRunner.prepare` (the scheduled sequences' new
tokens packed into one flat batch, described in a :class:`Context`), :meth:`forward`
(the model over it) and :meth:`sample` (logits and tokens): only sequences whose
last token is computed this step get logits and a sample.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch import nn

from engine.config import KV_TOKENS_PER_SEQ, EngineConfig
from engine.core.cuda_graphs import DecodeGraphs, GraphCapture
from engine.core.sampler import SampledToken
from engine.core.sampler import sample as sample_rows
from engine.core.scheduler import SchedulerOutput
from engine.core.speculative import verify
from engine.core.warmup import WarmupReport, warm_up
from engine.layers.attention import Attention
from engine.layers.context import Context, make_context, reset_context, set_context
from engine.model_config import ModelConfig

log = logging.getLogger(__name__)

_GIB = 1 << 30


def _some_blocks(blocks: int, budget: str) -> int:
    """``blocks``, or an error that says which ``budget`` left no room for one."""
    if blocks <= 0:
        raise RuntimeError(f"no room for the KV cache: {budget}")
    return blocks


class CausalLM(Protocol):
    """What the runner needs of a model (engine/models/*): hidden states per token, then logits."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
    def modules(self) -> Iterator[nn.Module]: ...


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = engine_config.block_size
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        if not self.attention_layers:
            raise ValueError("the model has no engine.layers.attention.Attention layers")
        self.cache_dtype = self.attention_layers[0].cache_dtype(dtype)
        self.num_kv_heads = model_config.num_key_value_heads
        self.head_dim = model_config.head_dim
        self.max_context = model_config.max_position_embeddings
        # Only LongRoPE reads how far each sequence's forward reaches (rotary.longrope_rows): other
        # models' steps build no such list.
        self.tracks_rope_reach = (model_config.rope_scaling or {}).get("rope_type") == "longrope"
        if engine_config.max_model_len is not None:
            self.max_context = min(self.max_context, engine_config.max_model_len)
        if engine_config.num_kv_blocks is not None:
            self.num_blocks = engine_config.num_kv_blocks
        else:
            self.num_blocks = self._blocks_from_budget(engine_config, engine_config.max_num_batched_tokens)
        # One block more than the scheduler hands out: the scratch block padding rows and warm-up
        # steps write their K/V to (engine/core/warmup.py, engine/core/cuda_graphs.py).
        self.scratch_block = self.num_blocks
        # Sliding-window layers keep their KV in a pool of their own, whose blocks out of the window
        # are freed as a sequence runs (engine/cache/block_manager.py); the others in the main pool.
        local = [layer for layer in self.attention_layers if layer.window is not None]
        full = [layer for layer in self.attention_layers if layer.window is None]
        self.window = max((layer.window or 0 for layer in local), default=0) or None
        self.kv_cache = self._pool(full)
        self.local_kv_cache = self._pool(local) if local else None
        self.graphs: DecodeGraphs | None = None
        """Decode steps replayed as CUDA graphs, once :meth:`warm_up` captured them."""
        log.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB%s)",
            self.num_blocks,
            self.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / _GIB,
            f", {len(local)} sliding-window layers in a pool of their own" if local else "",
        )

    def _pool(self, layers: list[Attention]) -> torch.Tensor:
        """A zeroed pool of ``num_blocks`` blocks and the scratch block for ``layers``, each layer
        given its slice."""
        shape = (2, len(layers), self.num_blocks + 1, self.block_size, self.num_kv_heads, self.head_dim)
        pool = _zeroed_pool(shape, self.cache_dtype, self.device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = pool[0, i], pool[1, i]
        return pool

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty(0, dtype=self.cache_dtype).element_size()
        per_token = 2 * len(self.attention_layers) * self.num_kv_heads * self.head_dim * itemsize
        return per_token * self.block_size

    def _blocks_from_budget(self, config: EngineConfig, warmup_tokens: int) -> int:
        """KV blocks that fit the budget; an error that names the budget where not one block does."""
        if self.device.type != "cuda":
            if config.kv_cache_gib is not None:
                return _some_blocks(
                    int(config.kv_cache_gib * _GIB // self.bytes_per_block),
                    f"--kv-cache-gib {config.kv_cache_gib} holds no block of {self.block_size} tokens "
                    f"({self.bytes_per_block} bytes)",
                )
            tokens = max(self.max_context, config.max_num_seqs * KV_TOKENS_PER_SEQ)
            return -(-tokens // self.block_size)
        # Measure the activation peak of the largest step, then give the rest of the budget to the cache.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        with torch.inference_mode():
            ids = torch.zeros(warmup_tokens, dtype=torch.long, device=self.device)
            hidden = self.model(ids, torch.arange(warmup_tokens, device=self.device))
            self.model.compute_logits(hidden[-min(warmup_tokens, config.max_num_seqs) :])
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        in_use_elsewhere = total - free - torch.cuda.memory_allocated(self.device)
        budget = total * config.gpu_memory_utilization - in_use_elsewhere - peak
        return _some_blocks(
            int(budget // self.bytes_per_block),
            f"--gpu-memory-utilization {config.gpu_memory_utilization} allows "
            f"{total * config.gpu_memory_utilization / _GIB:.1f} GiB of this GPU's {total / _GIB:.1f}, other "
            f"processes use {in_use_elsewhere / _GIB:.1f} GiB and the model with its largest step "
            f"{peak / _GIB:.1f} GiB; free GPU memory (another engine on this GPU?), raise "
            "--gpu-memory-utilization or lower --max-num-batched-tokens",
        )

    def warm_up(self, config: EngineConfig, capture: GraphCapture | None = None) -> WarmupReport:
        """Compile the model's kernel shapes and capture its decode graphs (``engine/core/warmup.py``);
        ``capture`` replaces CUDA's graph capture (tests on CPU)."""
        report, self.graphs = warm_up(
            self.model,
            config,
            device=self.device,
            scratch_block=self.scratch_block,
            block_size=self.block_size,
            max_blocks=-(-self.max_context // self.block_size),
            # A sliding-window model's second block table is not among the graphs' static inputs.
            graph_safe=self.local_kv_cache is None
            and all(layer.backend.graph_safe for layer in self.attention_layers),
            capture=capture,
        )
        return report

    @torch.inference_mode()
    def run(self, batch: SchedulerOutput) -> list[list[SampledToken]]:
        """Compute the batch's new tokens. A sequence whose last token is computed gets one sampled
        token, or with draft tokens (speculative decoding) the drafts it keeps and one more; the
        others (prompts still being prefilled) get none."""
        self.copy_blocks(batch.block_copies)
        step = self.prepare(batch)
        hidden = self.forward(step)
        return self.sample(batch, step, hidden)

    def release_free_blocks(self, blocks: list[int], local_blocks: list[int]) -> int:
        """Give back the pages of free KV blocks (``blocks`` of the main pool, ``local_blocks`` of the
        sliding-window layers'); they read as zeros again, as never-written ones. Bytes given back."""
        released = release_block_pages(self.kv_cache, blocks)
        if self.local_kv_cache is not None:
            released += release_block_pages(self.local_kv_cache, local_blocks)
        return released

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of whole KV blocks (src, dst) the scheduler asked for, before the forward."""
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def prepare(self, batch: SchedulerOutput) -> PreparedStep:
        """Pack the scheduled sequences' new tokens into one flat batch and describe it for attention."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        # What attention sees: one entry per sequence, except that a sequence with drafts is one
        # single-token entry per row (row j attends to the keys before it and itself), so each
        # row is computed exactly as a plain decode at that position would be: greedy output
        # cannot tell speculation on from off.
        query_lens: list[int] = []
        context_lens: list[int] = []
        block_tables: list[list[int]] = []
        windowed = self.local_kv_cache is not None
        local_tables: list[list[int]] = []
        local_slots: list[int] = []
        rope_reach: list[int] = []  # LongRoPE's choice: a prompt's end while prefilling, else the context
        sampling: list[int] = []  # the sequences that sample this step
        logit_rows: list[int] = []  # rows of the flat batch that need logits, in sampling order
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            tokens = seq.token_ids + seq.draft_token_ids if seq.draft_token_ids else seq.token_ids
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if end == len(tokens):
                sampling.append(i)
                last = len(input_ids) + n - 1
                logit_rows.extend(range(last - len(seq.draft_token_ids), last + 1))
            input_ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            rows = n if seq.draft_token_ids else 1
            if windowed:
                local = seq.local_block_table
                local_slots.extend(local[p // bs] * bs + p % bs for p in range(start, end))
                local_tables.extend([local] * rows)
            if self.tracks_rope_reach:
                reach = max(end, seq.num_prompt_tokens) if start < seq.num_prompt_tokens else end
                rope_reach.extend(range(start + 1, end + 1) if seq.draft_token_ids else [reach])
            if seq.draft_token_ids:
                query_lens.extend([1] * n)
                context_lens.extend(range(start + 1, end + 1))
            else:
                query_lens.append(n)
                context_lens.append(end)
            block_tables.extend([table] * rows)
        context = make_context(
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=block_tables,
            slot_mapping=slots,
            device=self.device,
            local_block_tables=local_tables if windowed else None,
            local_slot_mapping=local_slots if windowed else None,
            rope_reach=rope_reach if self.tracks_rope_reach else None,
        )
        return PreparedStep(input_ids, positions, context, sampling, logit_rows)

    def forward(self, step: PreparedStep) -> torch.Tensor:
        """The model over the flat batch, with the step's context set for attention: hidden [T, H]."""
        if self.graphs is not None:
            hidden = self.graphs.run(step.input_ids, step.positions, step.context)
            if hidden is not None:
                return hidden
        set_context(step.context)
        try:
            ids = torch.tensor(step.input_ids, dtype=torch.long, device=self.device)
            pos = torch.tensor(step.positions, dtype=torch.long, device=self.device)
            return self.model(ids, pos)
        finally:
            reset_context()

    def sample(
        self, batch: SchedulerOutput, step: PreparedStep, hidden: torch.Tensor
    ) -> list[list[SampledToken]]:
        """Logits for the rows that need them, then one batched sample for the sequences without
        drafts and a verification for each sequence with drafts."""
        results: list[list[SampledToken]] = [[] for _ in batch.seqs]
        if not step.sampling:
            return results
        if len(step.logit_rows) < hidden.shape[0]:  # else every row is a sampled decode: use them all as is
            hidden = hidden[torch.tensor(step.logit_rows, device=self.device)]
        logits = self.model.compute_logits(hidden).float()
        plain: list[int] = []  # sequences without drafts: one batched sample
        plain_rows: list[int] = []
        row = 0
        for i in step.sampling:
            seq = batch.seqs[i]
            if seq.draft_token_ids:
                k = len(seq.draft_token_ids)
                results[i] = verify(logits[row : row + k + 1], seq, seq.draft_token_ids)
                row += k + 1
            else:
                plain.append(i)
                plain_rows.append(row)
                row += 1
        if plain:
            rows = (
                logits
                if len(plain_rows) == logits.shape[0]
                else logits[torch.tensor(plain_rows, device=logits.device)]
            )
            for i, token in zip(plain, sample_rows(rows, [batch.seqs[i] for i in plain]), strict=True):
                results[i] = [token]
        return results


@dataclass
class PreparedStep:
    """One step's flat batch, as :meth:`ModelRunner.prepare` packed it."""

    input_ids: list[int]
    positions: list[int]
    context: Context
    """What attention reads: slots, block tables, lengths (engine/layers/context.py)."""
    sampling: list[int]
    """Indexes (in the batch) of the sequences that sample this step."""
    logit_rows: list[int]
    """Rows of the flat batch that need logits, in sampling order (a sequence's drafts and its last)."""


def _zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV pool. Zeros, not empty: padded reads are masked, but 0 * NaN would still
    poison the output. On CPU the pool is a private anonymous mapping, fresh zero pages advised
    against transparent huge pages: a page costs resident memory only once a token is written to it.
    (Each layer's keys and values are a region of their own, so with 2 MB pages, which numpy's
    zeros had asked for, a one-token request committed 2 MB per layer and kind: 118 of the default
    pool's 180 MB.)"""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps the mapping


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` (an address, not an ``mmap`` object: the pool tensor holds its mapping)."""
    try:
        madvise = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return cast(Callable[[int, int, int], int], madvise)


def release_block_pages(pool: torch.Tensor, blocks: list[int]) -> int:
    """Give back the whole pages of ``blocks`` in a CPU pool [k/v, layer, block, ...] from
    :func:`_zeroed_pool`: a private anonymous mapping, so a given-back page reads as zeros, what the
    block held before it was first written. The blocks must be free (nobody reads them). A run of
    written blocks a burst left free stayed resident after it (Gemma-3-1B: 424 KB a block over its two
    pools). Returns the bytes given back (0 on a GPU or without ``madvise``)."""
    madvise = _madvise()
    if pool.device.type != "cpu" or not blocks or madvise is None or not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    page = mmap.PAGESIZE
    block_bytes = pool[0, 0, 0].numel() * pool.element_size()
    slice_bytes = pool.shape[2] * block_bytes  # one layer's keys or values, every block
    ordered = sorted(blocks)
    runs: list[tuple[int, int]] = []  # [start, end) of consecutive blocks
    for b in ordered:
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    released = 0
    for region in range(pool.shape[0] * pool.shape[1]):
        base = pool.data_ptr() + region * slice_bytes
        for start, end in runs:
            low = -(-(base + start * block_bytes) // page) * page
            high = (base + end * block_bytes) // page * page
            if high > low and madvise(low, high - low, mmap.MADV_DONTNEED) == 0:
                released += high - low
    return released
