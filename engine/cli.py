"""``tern engine``: load a model and serve it (OpenAI API + internal RPC) with uvicorn."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence

from engine.config import EngineConfig
from engine.cpu.openmp import WAIT_POLICIES, restart_with_wait_policy
from engine.loader.memory import use_one_malloc_arena
from protocol.rpc import HEALTH_PATH, MODELS_PATH


def build_parser() -> argparse.ArgumentParser:
    defaults = EngineConfig()
    p = argparse.ArgumentParser(prog="tern engine", description="Serve a model with the Tern engine.")
    _model_and_batch_args(p, defaults)
    _execution_args(p, defaults)
    _threads_and_speculation_args(p, defaults)
    _integration_args(p, defaults)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def _model_and_batch_args(p: argparse.ArgumentParser, defaults: EngineConfig) -> None:
    """The model, where it serves, and the KV cache and batch sizes."""
    p.add_argument("--model", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument(
        "--served-model-name", help="name in /v1/models and the 'model' field (default: from the file)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=defaults.device)
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default=defaults.dtype)
    p.add_argument("--block-size", type=int, default=defaults.block_size, help="tokens per KV-cache block")
    p.add_argument("--kv-cache-gib", type=float, default=defaults.kv_cache_gib, help="KV-cache budget on CPU")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=defaults.gpu_memory_utilization,
        help="fraction of GPU memory to use on CUDA",
    )
    p.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs, help="most sequences per step")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults.max_num_batched_tokens,
        help="most tokens per step",
    )
    p.add_argument(
        "--max-model-len", type=int, help="context limit (default: the model's, capped by the cache)"
    )


def _execution_args(p: argparse.ArgumentParser, defaults: EngineConfig) -> None:
    """How each step runs: chunking, CUDA graphs, the prefix cache, quantization, the CPU kernels."""
    p.add_argument(
        "--no-chunked-prefill",
        dest="enable_chunked_prefill",
        action="store_false",
        help="prefill whole prompts",
    )
    p.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="on CUDA, run decode steps eagerly instead of replaying the CUDA graphs captured at load",
    )
    p.add_argument(
        "--no-prefix-cache",
        dest="enable_prefix_cache",
        action="store_false",
        help="do not reuse the KV blocks of shared prefixes (on by default; off for comparison)",
    )
    p.add_argument(
        "--quant",
        choices=["auto", "none", "int4", "bitnet"],
        default=defaults.quant,
        help="weight quantization (default: what the checkpoint holds; int4/bitnet quantize a float one)",
    )
    p.add_argument(
        "--cpu-kernels",
        choices=["auto", "c", "torch"],
        default=defaults.cpu_kernels,
        help="the CPU fast path's kernels: auto (the C kernels, float32 activations, for a GGUF "
        "wherever they build; else torch's, in bf16 where the CPU has it natively), c or torch",
    )
    p.add_argument(
        "--no-pack-cpu-linears",
        dest="pack_cpu_linears",
        action="store_false",
        help="on CPU in float32, do not keep a second, MKL-packed copy of each weight "
        "(it makes decode steps of 6 to 16 sequences faster)",
    )


def _threads_and_speculation_args(p: argparse.ArgumentParser, defaults: EngineConfig) -> None:
    """CPU threads, n-gram speculative decoding and OpenMP's wait policy."""
    p.add_argument(
        "--num-threads",
        type=int,
        help="torch CPU threads (default: OMP_NUM_THREADS, else the physical cores available: all of "
        "them on the C kernels' path, one fewer (at least 1) on the others; on a busy machine use fewer)",
    )
    p.add_argument(
        "--speculative",
        choices=["ngram", "off"],
        default=defaults.speculative,
        help="n-gram (prompt-lookup) speculative decoding: guesses next tokens from the text so far and "
        "checks them in one step (faster single streams when answers copy their input)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=defaults.num_speculative_tokens,
        help="most draft tokens per sequence per step",
    )
    p.add_argument("--ngram-min", type=int, default=defaults.ngram_min, help="shortest n-gram looked up")
    p.add_argument("--ngram-max", type=int, default=defaults.ngram_max, help="longest n-gram looked up")
    p.add_argument(
        "--speculative-max-batch",
        type=int,
        default=defaults.speculative_max_batch,
        help="no speculation in steps with more running sequences than this (default: 3 on CPU, 4 on CUDA)",
    )
    p.add_argument(
        "--omp-wait-policy",
        choices=WAIT_POLICIES,
        help="OpenMP workers at a barrier: passive sleeps at once (far steadier where other work shares "
        "the cores, slower on an idle machine), active spins; default: OMP_WAIT_POLICY, else libgomp's "
        "(spin, then sleep)",
    )


def _integration_args(p: argparse.ArgumentParser, defaults: EngineConfig) -> None:
    """What the engine shows others: metrics, KV events, chat template and tool-call formats."""
    p.add_argument(
        "--no-vllm-metrics",
        dest="vllm_metrics",
        action="store_false",
        help="do not also publish vLLM's metric names on /metrics (on by default: a Gateway API Inference "
        "Extension endpoint picker such as llm-d's reads them)",
    )
    p.add_argument(
        "--kv-events-port",
        type=int,
        nargs="?",
        const=5557,
        help="publish the prefix cache's changes as vLLM KV events (msgpack over ZMQ PUB) on this port "
        "(5557 when given without a value; off by default), for llm-d's precise prefix-cache routing",
    )
    p.add_argument(
        "--kv-events-replay-port", type=int, help="the events' replay (ROUTER) port (default: the port + 1)"
    )
    p.add_argument("--kv-events-topic", help="the events' topic (default: kv@<hostname>@<served model name>)")
    p.add_argument(
        "--chat-template-file",
        help="a Jinja chat template that replaces the model's own (its thinking markers and tool-call "
        "format are then read from it)",
    )
    p.add_argument(
        "--thinking-budget-chars",
        type=int,
        default=defaults.thinking_budget_chars,
        help="most characters a reasoning model thinks before a constrained answer (1-2048)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=["auto", "hermes", "llama3_json"],
        default=defaults.tool_call_parser,
        help="the format of the model's tool calls (default: read from the chat template)",
    )


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Every ``EngineConfig`` field that has a flag of the same name (``--max-num-seqs`` ->
    ``max_num_seqs``); the others keep their defaults."""
    names = {field.name for field in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{name: value for name, value in vars(args).items() if name in names})


PROBE_PATHS = frozenset({"/health", HEALTH_PATH, MODELS_PATH, "/metrics"})


class ProbeAccessFilter(logging.Filter):
    """Drops uvicorn access-log lines for health probes and metric scrapes: the gateway probes every
    engine every few seconds (health, then its model list), and those lines would bury the requests
    an operator looks for."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn's access record: (client address, method, path with query, HTTP version, status)
        path = args[2] if isinstance(args, tuple) and len(args) >= 3 else None
        return not (isinstance(path, str) and path.split("?", 1)[0] in PROBE_PATHS)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    restart_with_wait_policy(args.omp_wait_policy, sys.argv[1:] if argv is None else argv)
    use_one_malloc_arena()  # before any thread starts: what bursts free goes back when idle
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvicorn

    from engine.core.llm_engine import LLMEngine
    from engine.serving.server import create_app

    engine = LLMEngine.from_config(config_from_args(args))
    logging.getLogger(__name__).info(
        "serving %s on http://%s:%d (%s, %d KV blocks)",
        engine.model_name,
        args.host,
        args.port,
        engine.device,
        engine.runner.num_blocks,
    )
    server_config = uvicorn.Config(
        create_app(engine), host=args.host, port=args.port, log_level=args.log_level
    )
    logging.getLogger("uvicorn.access").addFilter(ProbeAccessFilter())  # after uvicorn's logging setup
    uvicorn.Server(server_config).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
