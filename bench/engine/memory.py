"""Where an engine's resident memory goes, phase by phase: one JSON object.

In one process, the way ``tern engine`` starts: Python alone, ``import torch``, the server's modules,
the model loaded (``load_for_engine``), the engine built (its KV pool), a warm-up at one stream, then
a run at 16 streams (greedy, ``ignore_eos``, the benchmark prompts as chats: the load
``engine_vs_llamacpp.sh`` puts on a server), then one 2,048-token prompt (its prefill's buffers are
the largest a run allocates). After each phase it reads ``/proc/self/status`` and
``/proc/self/smaps`` and splits the resident pages by mapping:

- ``model_file``: the model file's mapping (of it ``model_file_private``: pages the process rewrote
  in place, the kernels' layouts), ``kv_pool``: the KV cache's mappings (pages written so far; with
  sliding-window layers, Gemma 3's, their pool of their own too: the kernel may merge the two),
- ``heap`` (``[heap]``: glibc's main arena), ``anon`` (other anonymous mappings: Python's object
  arenas, large allocations, threads' arenas), ``libraries`` (shared objects, their code and data),
  ``other`` (stacks and the rest), plus the biggest libraries and the count of imported modules.

A last phase calls ``malloc_trim``: what it gives back was freed memory the C library kept.

    python -m bench.engine.memory [--engine-args "--model X.gguf --num-threads 2"] \
        [--requests 64] [--concurrency 16] [--max-tokens 128] [--long-prompt-tokens 2048]

Nothing here imports torch before its phase, so the first two phases are what they say.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.engine import PROMPTS, cpu_model

if TYPE_CHECKING:
    from engine.core.llm_engine import LLMEngine

_MB = 1024  # smaps and status count kB


def status() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile and VmHWM of this process, in MB."""
    wanted = {"VmRSS", "RssAnon", "RssFile", "VmHWM"}
    out: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in wanted:
            out[key] = int(value.split()[0]) // _MB
    return out


def smaps_breakdown(model_file: str | None, pools: list[tuple[int, int]]) -> dict[str, Any]:
    """Resident MB by kind of mapping (module docstring); ``pools``: the KV pools' address ranges."""
    kinds: Counter[str] = Counter()
    libraries: Counter[str] = Counter()
    kind, library = "other", ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            start, end = (int(x, 16) for x in fields[0].split("-"))
            path = fields[5] if len(fields) > 5 else ""
            library = ""
            if model_file is not None and path == model_file:
                kind = "model_file"
            elif any(start < pool_end and pool_start < end for pool_start, pool_end in pools):
                kind = "kv_pool"
            elif ".so" in path:
                kind, library = "libraries", path.rsplit("/", 1)[-1].split(".so")[0]
            elif path == "[heap]":
                kind = "heap"
            else:
                kind = "anon" if not path else "other"
        elif fields[0] == "Rss:":
            kinds[kind] += int(fields[1])
            if library:
                libraries[library] += int(fields[1])
        elif fields[0] == "Anonymous:" and kind == "model_file":
            kinds["model_file_private"] += int(fields[1])
    out: dict[str, Any] = {k: round(v / _MB, 1) for k, v in sorted(kinds.items())}
    out["top_libraries"] = {name: round(v / _MB, 1) for name, v in libraries.most_common(5)}
    return out


class Phases:
    """Records each phase's figures as it ends."""

    def __init__(self) -> None:
        self.model_file: str | None = None
        self.pools: list[tuple[int, int]] = []
        self.phases: list[dict[str, Any]] = []

    def mark(self, name: str, **extra: Any) -> None:
        record = {"phase": name, **status(), **smaps_breakdown(self.model_file, self.pools)}
        record["modules"] = len(sys.modules)
        record.update(extra)
        self.phases.append(record)
        print(f"{name}: VmRSS {record['VmRSS']} MB", file=sys.stderr, flush=True)


def run_streams(
    engine: LLMEngine, prompts: list[list[int]], requests: int, concurrency: int, max_tokens: int
) -> float:
    """``requests`` greedy requests, ``concurrency`` in flight at once (a new one as one ends);
    returns the seconds taken."""
    from engine.core.outputs import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    started, sent, done = time.perf_counter(), 0, 0
    while done < requests:
        while sent < requests and engine.num_requests < concurrency:
            engine.add_request(
                EngineRequest(f"m{sent}-{time.monotonic_ns()}", prompts[sent % len(prompts)], params)
            )
            sent += 1
        for out in engine.step():
            done += out.usage is not None
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-args", default="", help="`tern engine` flags (--model, --num-threads, ...)")
    ap.add_argument("--warmup-requests", type=int, default=4, help="requests at one stream first")
    ap.add_argument("--requests", type=int, default=64, help="requests of the multi-stream run")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--long-prompt-tokens", type=int, default=2048, help="then one prompt this long, 16 tokens (0: none)"
    )
    args = ap.parse_args(argv)
    phases = Phases()
    phases.mark("python")

    import torch  # noqa: F401  (the phase is its import)

    phases.mark("import torch")
    from engine.cli import build_parser, config_from_args  # what `tern engine` imports first
    from engine.core.llm_engine import LLMEngine
    from engine.loader.load import default_model_path
    from engine.loader.memory import release_freed_memory
    from engine.loader.serving import load_for_engine
    from engine.serving.server import create_app

    phases.mark("import server")
    config = config_from_args(build_parser().parse_args(shlex.split(args.engine_args)))
    phases.model_file = str(Path(config.model).resolve()) if config.model else str(default_model_path())
    loaded = load_for_engine(config)
    phases.mark("loaded")
    engine = LLMEngine.from_loaded(config, loaded)
    create_app(engine)
    pool = engine.runner.kv_cache
    pool_bytes = pool.numel() * pool.element_size()
    local = engine.runner.local_kv_cache
    local_bytes = 0 if local is None else local.numel() * local.element_size()
    phases.pools = [(pool.data_ptr(), pool.data_ptr() + pool_bytes)]
    if local is not None:
        phases.pools.append((local.data_ptr(), local.data_ptr() + local_bytes))
    phases.mark(
        "engine built",
        kv_pool_mb=round(pool_bytes / 2**20, 1),
        kv_local_pool_mb=round(local_bytes / 2**20, 1),  # the sliding-window layers' pool
        kv_blocks=engine.runner.num_blocks,
        kv_tokens=engine.runner.num_blocks * engine.runner.block_size,
        kv_dtype=str(pool.dtype).removeprefix("torch."),  # float16 on the C fast path, else the model's
    )
    prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    seconds = run_streams(engine, prompts, args.warmup_requests, 1, args.max_tokens)
    phases.mark("warm-up, 1 stream", seconds=round(seconds, 1))
    seconds = run_streams(engine, prompts, args.requests, args.concurrency, args.max_tokens)
    phases.mark(f"{args.concurrency} streams", seconds=round(seconds, 1))
    if args.long_prompt_tokens:
        from bench.engine.long_prompts import long_prompts

        long = long_prompts(loaded.tokenizer, args.long_prompt_tokens, 1)
        seconds = run_streams(engine, long, 1, 1, 16)
        phases.mark(f"{args.long_prompt_tokens}-token prompt", seconds=round(seconds, 1))
    release_freed_memory()  # what of the heap is freed memory glibc kept, not memory in use
    phases.mark("malloc_trim")
    print(
        json.dumps(
            {
                "benchmark": "engine-memory",
                "model": phases.model_file,
                "engine_args": args.engine_args,
                "requests": args.requests,
                "concurrency": args.concurrency,
                "max_tokens": args.max_tokens,
                "cpu": cpu_model(),
                "phases": phases.phases,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
