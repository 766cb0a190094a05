"""Warm-up at load and decode steps replayed as graphs (issue 50), on CPU.

The tiny engine runs the Triton paged-attention backend in Triton's CPU interpreter, the backend
CUDA uses. Only CUDA's graph capture, the launch boundary, is replaced: :class:`RerunCapture`
records the captured function and replays it into the same output tensor, reading the same static
input buffers a CUDA graph reads, so a step whose inputs were not copied in would come out wrong.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core.cuda_graphs import capture_sizes
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import EngineRequest
from engine.core.outputs import SamplingParams as CoreSamplingParams
from engine.core.warmup import prefill_buckets
from engine.layers.attention import set_decode_backend
from engine.layers.attention_backends import TritonDecode
from engine.layers.context import make_context
from tests.engine.tiny_engine import EngineFactory


class RerunCapture:
    """CPU stand-in for ``CudaGraphCapture``: replay runs the captured function again into its output."""

    def __init__(self) -> None:
        self.captured: list[int] = []
        self.replays = 0

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        out = fn()
        self.captured.append(out.shape[0])

        def replay() -> None:
            self.replays += 1
            out.copy_(fn())

        return replay, out


def triton_engine(make_engine: EngineFactory) -> LLMEngine:
    engine = make_engine(max_num_seqs=5, max_num_batched_tokens=64, speculative="off")
    set_decode_backend(engine.runner.model, TritonDecode())  # type: ignore[arg-type]
    return engine


def greedy_tokens(engine: LLMEngine, prompts: list[str]) -> dict[str, list[int]]:
    sampling = CoreSamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    requests = [EngineRequest(f"r{i}", engine.tokenizer.encode(p), sampling) for i, p in enumerate(prompts)]
    outputs = engine.generate(requests)
    return {rid: [t for d in out.deltas for t in d.token_ids] for rid, out in outputs.items()}


def test_capture_sizes_and_prefill_buckets() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]
    assert prefill_buckets(1024) == [32, 64, 128, 256, 512]
    assert prefill_buckets(100) == [32, 64]


def test_warm_up_captures_each_batch_size_and_writes_only_the_scratch_block(
    make_engine: EngineFactory,
) -> None:
    engine = triton_engine(make_engine)
    runner = engine.runner
    capture = RerunCapture()
    report = runner.warm_up(engine.config, capture=capture)
    assert report.decode_sizes == report.graph_sizes == [1, 2, 4, 5]
    assert sorted(capture.captured) == [1, 2, 4, 5]
    assert report.prefill_tokens == [32, 64]
    assert runner.scratch_block == runner.num_blocks == engine.block_manager.num_blocks
    assert not runner.kv_cache[:, :, : runner.num_blocks].any(), "warm-up wrote to a block a sequence may own"
    assert runner.kv_cache[:, :, runner.scratch_block].any()


def test_graph_replay_gives_the_eager_tokens(make_engine: EngineFactory) -> None:
    """Three streams (padded to the 4-row graph, then fewer) decode the same greedy tokens replayed
    as eagerly, and the replays did run."""
    prompts = ["hello", "a", "the fox"]
    eager = greedy_tokens(triton_engine(make_engine), prompts)
    engine = triton_engine(make_engine)
    capture = RerunCapture()
    engine.runner.warm_up(engine.config, capture=capture)
    assert greedy_tokens(engine, prompts) == eager
    assert capture.replays >= 3


def test_steps_that_do_not_fit_a_graph_run_eagerly(make_engine: EngineFactory) -> None:
    engine = triton_engine(make_engine)
    engine.runner.warm_up(engine.config, capture=RerunCapture())
    graphs = engine.runner.graphs
    assert graphs is not None
    decode = make_context(query_lens=[1, 1, 1], context_lens=[3, 5, 2], block_tables=[[0], [1, 2], [3]],
                          slot_mapping=[2, 8, 13])  # fmt: skip
    assert graphs.size_for(decode, 3) == 4
    prefill = make_context(
        query_lens=[1, 3], context_lens=[3, 3], block_tables=[[0], [1]], slot_mapping=[2, 4, 5, 6]
    )
    assert graphs.size_for(prefill, 4) is None
    wide = make_context(query_lens=[1], context_lens=[1], block_tables=[list(range(graphs.max_blocks + 1))],
                        slot_mapping=[0])  # fmt: skip
    assert graphs.size_for(wide, 1) is None


def test_no_graphs_when_turned_off_or_the_backend_reads_host_lengths(make_engine: EngineFactory) -> None:
    off = make_engine(max_num_seqs=2, max_num_batched_tokens=32, cuda_graphs=False)
    set_decode_backend(off.runner.model, TritonDecode())  # type: ignore[arg-type]
    assert off.runner.warm_up(off.config, capture=RerunCapture()).graph_sizes == []
    torch_backend = make_engine(max_num_seqs=2, max_num_batched_tokens=32)  # TorchDecode: host lengths
    report = torch_backend.runner.warm_up(torch_backend.config, capture=RerunCapture())
    assert report.graph_sizes == [] and report.decode_sizes == [1, 2]
    assert torch_backend.runner.graphs is None
