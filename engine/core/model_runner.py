"""Owns the model and its KV-cache pool; runs one scheduled step and samples.

It sizes the pool from the memory budget, hands each attention layer its slice
of the pool, and for every step packs the scheduled sequences' new tokens into
one flat batch, describes the batch in a :class:`Context` and runs the model.
Only sequences whose last token is computed this step get logits and a sample.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Protocol

import numpy as np
import torch
from torch import nn

from engine.config import KV_TOKENS_PER_SEQ, EngineConfig
from engine.core.context import make_context, reset_context, set_context
from engine.core.sampler import SampledToken, sample
from engine.core.scheduler import SchedulerOutput
from engine.layers.attention import Attention
from engine.model_config import ModelConfig

log = logging.getLogger(__name__)

_GIB = 1 << 30


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
        self.num_kv_heads = model_config.num_key_value_heads
        self.head_dim = model_config.head_dim
        self.max_context = model_config.max_position_embeddings
        if engine_config.max_model_len is not None:
            self.max_context = min(self.max_context, engine_config.max_model_len)
        if engine_config.num_kv_blocks is not None:
            self.num_blocks = engine_config.num_kv_blocks
        else:
            self.num_blocks = self._blocks_from_budget(engine_config, engine_config.max_num_batched_tokens)
        if self.num_blocks <= 0:
            raise RuntimeError("the memory budget leaves no room for the KV cache")
        layers = len(self.attention_layers)
        shape = (2, layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache = _zeroed_pool(shape, dtype, device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache = self.kv_cache[0, i]
            layer.v_cache = self.kv_cache[1, i]
        log.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            self.num_blocks,
            self.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / _GIB,
        )

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        per_token = 2 * len(self.attention_layers) * self.num_kv_heads * self.head_dim * itemsize
        return per_token * self.block_size

    def _blocks_from_budget(self, config: EngineConfig, warmup_tokens: int) -> int:
        if self.device.type != "cuda":
            if config.kv_cache_gib is not None:
                return int(config.kv_cache_gib * _GIB // self.bytes_per_block)
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
        return int(budget // self.bytes_per_block)

    @torch.inference_mode()
    def run(self, batch: SchedulerOutput) -> list[SampledToken | None]:
        """Compute the batch's new tokens; one sample per sequence whose last token was computed."""
        if batch.block_copies:
            src = torch.tensor([s for s, _ in batch.block_copies], device=self.device)
            dst = torch.tensor([d for _, d in batch.block_copies], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        sample_rows: list[int] = []
        last_rows: list[int] = []  # each sequence's last row in the flat batch
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            last_rows.append(len(input_ids) + n - 1)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            context_lens.append(end)
            if end == seq.num_tokens:
                sample_rows.append(i)

        set_context(
            make_context(
                query_lens=batch.num_new_tokens,
                context_lens=context_lens,
                block_tables=[seq.block_table for seq in batch.seqs],
                slot_mapping=slots,
                device=self.device,
            )
        )
        try:
            ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)
            hidden = self.model(ids, pos)
        finally:
            reset_context()

        results: list[SampledToken | None] = [None] * len(batch.seqs)
        if not sample_rows:
            return results
        if len(sample_rows) < hidden.shape[0]:  # else every row is a sampled decode: use them all as is
            hidden = hidden[torch.tensor([last_rows[i] for i in sample_rows], device=self.device)]
        logits = self.model.compute_logits(hidden).float()
        for i, token in zip(sample_rows, sample(logits, [batch.seqs[i] for i in sample_rows]), strict=True):
            results[i] = token
        return results


def _zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV pool. Zeros, not empty: padded reads are masked, but 0 * NaN would still
    poison the output. On CPU the zeros come from calloc (through numpy), whose large allocations are
    fresh zero pages: a block costs resident memory only once a token is written to it."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(math.prod(shape) * itemsize, dtype=np.uint8))
    return raw.view(dtype).view(shape)
