"""The shared-prefix benchmark's workload, its theoretical hit rate, and one tiny run over HTTP."""

from __future__ import annotations

import asyncio

from bench.engine.shared_prefix import Workload, run, theoretical_max_hit_rate
from engine.serving.server import create_app
from tests.engine.tiny_engine import make_byte_tokenizer, make_tiny_engine
from tests.gateway.live_server import ServerThread


def test_theoretical_max_counts_the_longest_earlier_prefix_but_not_the_last_token() -> None:
    prompts = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3], [9]]
    # 0 + 3 (shares 1,2,3) + 2 (its last token must be computed) + 0, over 12 tokens.
    assert theoretical_max_hit_rate(prompts) == 5 / 12


def test_workload_groups_share_their_system_prompt() -> None:
    workload = Workload(3, 4, 10, 5, 2, (0, 100), seed=1)
    prompts = workload.prompts()
    assert len(prompts) == 12 and all(len(p) == 15 for p in prompts)
    groups = [prompts[i : i + 4] for i in range(0, 12, 4)]
    assert all(len({tuple(p[:10]) for p in g}) == 1 for g in groups)
    assert len({tuple(g[0][:10]) for g in groups}) == 3
    assert prompts == Workload(3, 4, 10, 5, 2, (0, 100), seed=1).prompts()


def test_run_against_a_tiny_engine_reaches_the_theoretical_hit_rate() -> None:
    llm = make_tiny_engine(make_byte_tokenizer(), num_kv_blocks=256, enable_prefix_cache=True)
    server = ServerThread(create_app(llm)).start()
    try:
        workload = Workload(2, 3, 21, 4, 2, (0, 256), seed=3)
        result = asyncio.run(run(server.url, workload, max_concurrency=None))
    finally:
        server.stop()
    assert result["num_requests"] == 6 and result["prompt_tokens"] == 6 * 25
    assert result["theoretical_max_hit_rate"] == round(2 * 2 * 21 / 150, 4)
    assert result["hit_rate_of_max"] >= 0.9  # type: ignore[operator]
    assert result["ttft_p50_ms"] <= result["ttft_p99_ms"]  # type: ignore[operator]
