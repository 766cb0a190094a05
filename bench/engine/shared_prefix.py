"""Shared-prefix benchmark: SGLang bench_serving's ``generated-shared-prefix`` workload.

Groups of requests share a long system prompt, each request with its own question:
the traffic a prefix cache is for. Runs against a running engine with the client of
``bench.engine.serving`` (the internal RPC, greedy, ``ignore_eos``; token-id prompts
so the shared part is exact) and prints one JSON line: throughput, time to first
token (p50/p99), the cache hit rate the engine reported (``cached_tokens`` in each
final frame) and the workload's theoretical maximum hit rate (every request after
the first of its group reuses the system prompt).

    python -m bench.engine.shared_prefix --url http://127.0.0.1:8100 --num-groups 4 ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from bench.engine.serving import RequestResult, one_request, percentile


@dataclass(frozen=True)
class Workload:
    num_groups: int
    prompts_per_group: int
    system_prompt_len: int
    question_len: int
    output_len: int
    token_range: tuple[int, int]
    seed: int

    def prompts(self) -> list[list[int]]:
        """Group by group, like SGLang: each group's system prompt, then one question per request."""
        rng = random.Random(self.seed)
        lo, hi = self.token_range

        def tokens(n: int) -> list[int]:
            return [rng.randrange(lo, hi) for _ in range(n)]

        prompts = []
        for _ in range(self.num_groups):
            system = tokens(self.system_prompt_len)
            prompts.extend(system + tokens(self.question_len) for _ in range(self.prompts_per_group))
        return prompts


def theoretical_max_hit_rate(prompts: Sequence[list[int]]) -> float:
    """Share of prompt tokens an unbounded cache could serve, sending in this order.

    Each prompt can reuse its longest common prefix with any earlier prompt, except its
    last token (which must be computed to get logits).
    """
    reusable = 0
    for i, prompt in enumerate(prompts):
        best = 0
        for earlier in prompts[:i]:
            n = 0
            limit = min(len(prompt) - 1, len(earlier))
            while n < limit and prompt[n] == earlier[n]:
                n += 1
            best = max(best, n)
        reusable += best
    return reusable / sum(len(p) for p in prompts)


async def run(url: str, workload: Workload, max_concurrency: int | None) -> dict[str, object]:
    prompts = workload.prompts()
    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        # Warm-up on tokens outside the workload, so one-time costs do not land on the first group.
        await one_request(client, url, "shared-prefix-warmup", [workload.token_range[0]] * 8, 2)

        async def limited(i: int, prompt: list[int]) -> RequestResult:
            async with limit:
                return await one_request(client, url, f"shared-prefix-{i}", prompt, workload.output_len)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(i, p) for i, p in enumerate(prompts)))
        duration = time.perf_counter() - start

    ttfts = [r.ttft for r in results]
    prompt_tokens = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    output = sum(r.completion_tokens for r in results)
    max_rate = theoretical_max_hit_rate(prompts)
    return {
        "workload": "generated-shared-prefix",
        **{k: v for k, v in vars(workload).items() if k != "token_range"},
        "max_concurrency": max_concurrency,
        "num_requests": len(results),
        "duration_s": round(duration, 3),
        "request_throughput": round(len(results) / duration, 4),
        "output_throughput_tok_s": round(output / duration, 2),
        "total_throughput_tok_s": round((prompt_tokens + output) / duration, 2),
        "ttft_p50_ms": round(percentile(ttfts, 50) * 1000, 1),
        "ttft_p99_ms": round(percentile(ttfts, 99) * 1000, 1),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "cache_hit_rate": round(cached / prompt_tokens, 4),
        "theoretical_max_hit_rate": round(max_rate, 4),
        "hit_rate_of_max": round(cached / prompt_tokens / max_rate, 4) if max_rate else None,
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8100")
    p.add_argument("--num-groups", type=int, default=4)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--system-prompt-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=None, help="default: send everything at once")
    p.add_argument(
        "--token-range",
        type=int,
        nargs=2,
        default=(1000, 20000),
        help="prompt token ids are drawn from [LO, HI) (default suits the SmolLM2 vocabulary)",
    )
    p.add_argument(
        "--seed", type=int, default=None, help="default: a fresh one, so no run hits an earlier run's cache"
    )
    args = p.parse_args(argv)
    workload = Workload(
        num_groups=args.num_groups,
        prompts_per_group=args.prompts_per_group,
        system_prompt_len=args.system_prompt_len,
        question_len=args.question_len,
        output_len=args.output_len,
        token_range=tuple(args.token_range),
        seed=random.randrange(1 << 32) if args.seed is None else args.seed,
    )
    print(json.dumps(asyncio.run(run(args.url.rstrip("/"), workload, args.max_concurrency))))


if __name__ == "__main__":
    main()
