"""The engine loop: ``step()`` = schedule -> run the model -> turn sampled tokens into outputs.

The engine is single-threaded by design: one owner (the server's step thread,
a benchmark, a test) calls :meth:`add_request`, :meth:`abort_request` and
:meth:`step`. It speaks its own types (``engine/core/outputs.py``): requests come
in tokenised, and each step returns plain :class:`RequestOutput` data (token ids,
text deltas, finish reasons, logprobs) that the serving layer turns into frames.
Turning a sampled token into a delta (detokenising, stop strings, tool calls, whether the
choice ends) is ``engine/core/assembly.py``'s job; the engine ends the choices it says are done.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from engine.cache.block_allocator import BlockAllocator
from engine.cache.block_manager import BlockManager
from engine.cache.kv_events import KVEventLog
from engine.cache.prefix_cache import PrefixCachingBlockManager
from engine.cache.radix_cache import RadixCache
from engine.config import EngineConfig
from engine.core.assembly import ChoiceState, RequestState
from engine.core.model_runner import CausalLM, ModelRunner
from engine.core.outputs import (
    ChoiceDelta,
    EngineRequest,
    ErrorKind,
    FinishReason,
    RequestError,
    RequestOutput,
)
from engine.core.sampler import SampledToken
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.sequence import Sequence
from engine.core.speculative import NgramSpeculator
from engine.layers.packed_linear import activation_dtype
from engine.layers.rotary import fit_rotary_tables
from engine.metrics import EngineMetrics
from engine.model_config import ModelConfig
from engine.structured.grammar import GrammarCompiler
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.loader.load import LoadedModel

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        model_config: ModelConfig,
        model_name: str,
        steps_in_c: bool = False,
        kernel_paths: dict[str, str] | None = None,
    ) -> None:
        self.config = config
        self.kernel_paths = kernel_paths or {}
        """Each GGML type's C kernel path on this CPU (LoadedModel.kernel_paths), reported by /health."""
        self.device = config.resolved_device()
        self.dtype = activation_dtype(model)
        self.steps_in_c = steps_in_c
        """Decode steps run as one C call (the loader installed the C kernels: engine/loader/serving.py);
        on CPU the default thread count follows it (``default_num_threads``)."""
        if self.device.type == "cpu":
            torch.set_num_threads(config.resolved_num_threads(steps_in_c=self.steps_in_c))
        if config.chat_template_file:  # read here, so a missing file stops the engine before it serves
            tokenizer.chat_template = Path(config.chat_template_file).read_text()
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.model_name = config.served_model_name or model_name
        # Loaders type models as nn.Module; every engine model has the CausalLM methods the runner calls.
        self.runner = ModelRunner(cast(CausalLM, model), model_config, config, self.device, self.dtype)
        capacity = self.runner.num_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings, capacity)
        # Rotary rows for the positions a sequence or a (warm-up) prefill step reaches, not the
        # model's whole context; before warm-up captures graphs over the tables.
        fit_rotary_tables(model, max(self.max_model_len, config.max_num_batched_tokens))
        # Before the engine exists, so before the server binds: /health waits for warm-up.
        self.warmup = self.runner.warm_up(config) if self.device.type == "cuda" else None
        self.block_manager = self._make_block_manager(BlockAllocator(self.runner.num_blocks))
        max_batched = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            max_batched = max(max_batched, self.max_model_len)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max_batched,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self.metrics = EngineMetrics()
        if config.vllm_metrics:
            self.metrics.add_vllm_names(
                model_name=self.model_name, block_size=config.block_size, num_blocks=self.runner.num_blocks
            )
        self.kv_events: KVEventLog | None = None
        """Set by engine/serving/kv_publisher.py when KV events are on; flushed once per step."""
        self.speculator = (
            NgramSpeculator(
                num_tokens=config.num_speculative_tokens,
                ngram_min=config.ngram_min,
                ngram_max=config.ngram_max,
                max_batch=config.resolved_speculative_max_batch(self.device),
            )
            if config.speculative == "ngram"
            else None
        )
        self.grammars = GrammarCompiler(tokenizer, vocab_size=model_config.vocab_size, metrics=self.metrics)
        self._requests: dict[str, RequestState] = {}
        self._update_gauges()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load the configured model (None: the default SmolLM2 GGUF) and build an engine on it."""
        from engine.loader.serving import load_for_engine

        return cls.from_loaded(config, load_for_engine(config))

    @classmethod
    def from_loaded(cls, config: EngineConfig, loaded: LoadedModel) -> LLMEngine:
        """An engine on a model the loader already loaded (``from_config`` without the loading)."""
        return cls(
            config,
            model=loaded.model,
            tokenizer=loaded.tokenizer,
            model_config=loaded.config,
            model_name=loaded.name,
            steps_in_c=loaded.steps_in_c,
            kernel_paths=loaded.kernel_paths,
        )

    def _make_block_manager(self, allocator: BlockAllocator) -> BlockManager:
        """The prefix cache plugs in here (a BlockManager subclass that reuses cached blocks); the
        sliding-window layers' pool follows the runner's (``window``)."""
        window = self.runner.window
        if self.config.enable_prefix_cache:
            return PrefixCachingBlockManager(
                allocator, self.config.block_size, model_name=self.model_name, window=window
            )
        return BlockManager(allocator, self.config.block_size, window=window)

    def release_idle_kv(self) -> int:
        """Idle: give back the pages of the KV blocks written since and free now (neither a running
        sequence's nor kept by the prefix cache; a finished wave's duplicates of cached pages, its
        partial last pages). They cost memory again only when written again. Bytes given back."""
        if self.has_unfinished_requests():
            return 0
        local = self.block_manager.local
        return self.runner.release_free_blocks(
            self.block_manager.allocator.take_free_dirty(), local.take_free_dirty() if local else []
        )

    def prefix_cache(self) -> RadixCache | None:
        """The radix tree of cached blocks (None with the prefix cache off)."""
        manager = self.block_manager
        return manager.cache if isinstance(manager, PrefixCachingBlockManager) else None

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block, as vLLM's ``/reset_prefix_cache``; False while requests run."""
        cache = self.prefix_cache()
        if cache is None or self.has_unfinished_requests():
            return False
        cleared = cache.clear()
        self._update_gauges()
        return cleared

    # -- requests ------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Validate and queue a tokenised request; raises :class:`RequestError` for bad input."""
        if request.request_id in self._requests:
            raise RequestError(f"request id '{request.request_id}' is already in flight", param="request_id")
        prompt = request.prompt_token_ids
        self._check_prompt(prompt)
        sampling = request.sampling
        room = self.max_model_len - len(prompt)
        max_tokens = room if sampling.max_tokens is None else min(sampling.max_tokens, room)
        state = RequestState.start(request, self.tokenizer)
        first = self._new_sequence(state, index=0, max_tokens=max_tokens)
        state.choices[0].seq = first
        self._requests[request.request_id] = state
        self.scheduler.add(first)
        self._update_gauges()

    def _check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise RequestError("The prompt is empty.", param="prompt")
        if len(prompt) >= self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"has {len(prompt)} tokens, leaving no room for a completion. Please shorten the prompt.",
                kind=ErrorKind.CONTEXT_LENGTH_EXCEEDED,
                param="messages",
            )
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise RequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")

    def _new_sequence(self, state: RequestState, *, index: int, max_tokens: int) -> Sequence:
        sampling = state.request.sampling
        generator = torch.Generator(device=self.device)
        if sampling.seed is not None:
            generator.manual_seed(hash((sampling.seed, index)) & 0x7FFF_FFFF_FFFF_FFFF)
        else:
            generator.manual_seed(random.getrandbits(63))
        return Sequence(
            request_id=state.request.request_id,
            prompt_token_ids=state.request.prompt_token_ids,
            sampling=sampling,
            max_tokens=max_tokens,
            index=index,
            generator=generator,
            cache_namespace=state.request.cache_namespace,
            arrival_time=state.arrival_time,
            matcher=state.request.grammar.matcher() if state.request.grammar else None,
        )

    def abort_request(self, request_id: str, reason: FinishReason = "abort") -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its closing output (None if unknown)."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        out = RequestOutput(request_id)
        for index, choice in enumerate(state.choices):
            if choice.finish_reason is None:
                self._finish_choice(choice, reason)
                out.deltas.append(ChoiceDelta(index=index, finish_reason=reason))
        self._close_request(state, out)
        self._update_gauges()
        return out

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # -- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = self._abort_expired()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, max_model_len=self.max_model_len)
        batch = self.scheduler.schedule()
        if batch.num_preempted:
            self.metrics.preemptions.inc(batch.num_preempted)
        if not batch.is_empty:
            sampled = self.runner.run(batch)
            outputs.extend(self._postprocess(batch, sampled))
        self._update_gauges()
        return outputs

    def _abort_expired(self) -> list[RequestOutput]:
        now = time.time()
        expired = [
            rid for rid, s in self._requests.items() if s.request.deadline and s.request.deadline < now
        ]
        return [out for rid in expired if (out := self.abort_request(rid)) is not None]

    def _postprocess(self, batch: SchedulerOutput, sampled: list[list[SampledToken]]) -> list[RequestOutput]:
        """The scheduler applies the step to the sequences; this turns their new tokens into outputs."""
        now = time.monotonic()
        self._count_drafts(batch, sampled)
        outputs: dict[str, RequestOutput] = {}
        for seq, token in self.scheduler.postprocess(batch, sampled):
            if seq.is_finished:  # a token before this one (an accepted draft) ended the choice
                continue
            state = self._requests[seq.request_id]
            out = outputs.setdefault(seq.request_id, RequestOutput(seq.request_id))
            self._record_timing(seq, now)
            if seq.num_output_tokens == 1 and seq.index == 0:
                self.metrics.prompt_tokens.inc(len(state.request.prompt_token_ids))
                self.metrics.cached_prompt_tokens.inc(seq.num_cached_tokens)
                self._fork_choices(state, seq)
            out.deltas.append(self._emit(state, seq, token))
            if state.finished:
                self._close_request(state, out)
        return list(outputs.values())

    def _count_drafts(self, batch: SchedulerOutput, sampled: list[list[SampledToken]]) -> None:
        for seq, tokens in zip(batch.seqs, sampled, strict=True):
            if (proposed := len(seq.draft_token_ids)) and self.speculator is not None:
                accepted = len(tokens) - 1
                self.speculator.record(seq, proposed=proposed, accepted=accepted)
                self.metrics.draft_tokens.inc(proposed)
                self.metrics.accepted_draft_tokens.inc(accepted)
                self.metrics.draft_acceptance.observe(accepted / proposed)

    def _record_timing(self, seq: Sequence, now: float) -> None:
        self.metrics.generation_tokens.inc()
        if seq.first_token_time is None:
            seq.first_token_time = now
            if seq.index == 0:
                self.metrics.time_to_first_token.observe(now - seq.arrival_time)
        elif seq.last_token_time is not None:
            self.metrics.inter_token_latency.observe(now - seq.last_token_time)
        seq.last_token_time = now

    def _fork_choices(self, state: RequestState, parent: Sequence) -> None:
        """Start choices 1..n-1 once choice 0 has its prompt cached: they share its full prompt blocks."""
        for index in range(1, len(state.choices)):
            child = self._new_sequence(state, index=index, max_tokens=parent.max_tokens)
            state.choices[index].seq = child
            self.scheduler.add_forked(child, parent)

    def _emit(self, state: RequestState, seq: Sequence, token: SampledToken) -> ChoiceDelta:
        """One sampled token as a delta (engine/core/assembly.py); a finishing one ends its choice."""
        choice = state.choices[seq.index]
        delta = choice.emit(seq, token, self.tokenizer.eos_token_ids)
        if delta.finish_reason is not None:
            self._finish_choice(choice, delta.finish_reason)
        return delta

    def _finish_choice(self, choice: ChoiceState, reason: FinishReason) -> None:
        choice.finish_reason = reason
        if choice.seq is not None and not choice.seq.is_finished:
            self.scheduler.finish(choice.seq)

    def _close_request(self, state: RequestState, out: RequestOutput) -> None:
        out.usage = state.usage()
        del self._requests[state.request.request_id]
        self.metrics.requests_finished.labels(finish_reason=out.usage.finish_reason).inc()

    def _update_gauges(self) -> None:
        """After each step and each out-of-step change: the gauges, and the step's KV events."""
        free = self.block_manager.num_free_blocks
        self.metrics.set_queues(
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            blocks_used=self.block_manager.num_blocks - free,
            blocks_free=free,
            blocks_reclaimable=self.block_manager.num_reclaimable_blocks(),
        )
        if self.kv_events is not None:
            self.kv_events.flush()
        if (stats := self.block_manager.cache_stats()) is not None:
            self.metrics.set_prefix_cache(stats)

    # -- convenience -----------------------------------------------------------------------

    def generate(self, requests: list[EngineRequest]) -> dict[str, RequestOutput]:
        """Run requests to completion (tests, offline use): each request's deltas, in order, and usage."""
        results = {request.request_id: RequestOutput(request.request_id) for request in requests}
        for request in requests:
            self.add_request(request)
        while self.has_unfinished_requests():
            for out in self.step():
                result = results[out.request_id]
                result.deltas.extend(out.deltas)
                result.usage = out.usage or result.usage
        return results
