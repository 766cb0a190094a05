"""Runtime knobs of one engine process (the model's own shape lives in ``ModelConfig``)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.cpu import kernels as cpu_kernels


@dataclass
class EngineConfig:
    model: str | None = None
    """Path to a Hugging Face directory or a GGUF file; None serves the default SmolLM2 GGUF."""
    device: str = "auto"
    """auto | cpu | cuda; auto picks CUDA when available."""
    dtype: str = "auto"
    """auto | float32 | float16 | bfloat16. auto is bfloat16 on CUDA, and on a CPU with native bf16
    arithmetic (AVX512-BF16 or AMX) where torch's kernels serve (:meth:`EngineConfig.cpu_bf16_kernels`);
    float32 elsewhere. float32 is the exact path that matches transformers; the CPU fast path keeps a
    GGUF's quantized weights (docs/engine.md, "The CPU fast path")."""
    cpu_kernels: str = "auto"
    """auto | c | torch: the kernels of the CPU fast path (``--dtype auto``). auto: the C kernels of
    ``engine/cpu`` (float32 activations) for a GGUF wherever they build, else torch's kernels (in bf16
    where the CPU has it natively); c: the C kernels on any CPU; torch: torch's kernels everywhere."""
    block_size: int = 16
    """Tokens per KV-cache block (a power of two for the CUDA kernel)."""
    kv_cache_gib: float | None = None
    """KV-cache budget on CPU; None sizes it for the model: room for one request of the full context
    or ``KV_TOKENS_PER_SEQ`` tokens for each of ``max_num_seqs`` sequences, whichever is more."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the process may use on CUDA (weights + KV cache + activations)."""
    num_kv_blocks: int | None = None
    """Overrides the memory budget with an exact block count (tests, benchmarks)."""
    max_num_seqs: int = 64
    """Most sequences in one step's batch."""
    max_num_batched_tokens: int = 1024
    """Most new tokens in one step; with chunked prefill, long prompts are split to fit."""
    cuda_graphs: bool = True
    """On CUDA, replay decode steps as CUDA graphs captured at load (engine/core/cuda_graphs.py)."""
    max_model_len: int | None = None
    """Prompt plus output limit; None uses the model's own, capped by the KV-cache capacity."""
    enable_chunked_prefill: bool = True
    enable_prefix_cache: bool = True
    """Reuse KV blocks of earlier requests with the same prefix (the radix cache). Its tree keeps
    finished requests' blocks until the pool needs them, so ``num_free_blocks`` alone does not return
    to the pool size when a request ends: free + reclaimable does."""
    num_threads: int | None = None
    """torch intra-op threads on CPU; None: ``OMP_NUM_THREADS`` if set, else :func:`default_num_threads`
    (every physical core where decode steps run in C, else one fewer)."""
    served_model_name: str | None = None
    vllm_metrics: bool = True
    """Also publish vLLM's metric names (``vllm:num_requests_waiting``, ...) on ``/metrics``, which a
    Gateway API Inference Extension endpoint picker reads (engine/vllm_metrics.py)."""
    kv_events_port: int | None = None
    """Publish the prefix cache's changes as vLLM KV events on this ZMQ PUB port (5557 is vLLM's);
    None: off (engine/serving/kv_publisher.py)."""
    kv_events_replay_port: int | None = None
    """The replay (ROUTER) port; None: ``kv_events_port + 1`` when events are on."""
    kv_events_topic: str | None = None
    """None: ``kv@<hostname>@<served model name>``."""
    chat_template_file: str | None = None
    """A Jinja file that replaces the model's own chat template (llama-server's ``--chat-template-file``):
    the reasoning markers and the tool-call format are then read from it."""
    thinking_budget_chars: int = 2048
    """Where a reasoning model thinks before a constrained answer (``response_format``, a forced tool
    call), the most characters of thinking before the grammar closes the think block (at most 2048:
    engine/structured/reasoning.py)."""
    tool_call_parser: str = "auto"
    """auto | hermes | llama3_json: the format tool calls are parsed (and forced) in; auto reads it from
    the chat template (vLLM's ``--tool-call-parser``; docs/structured-output.md)."""
    quant: str = "auto"
    """auto | none | int4 | bitnet: auto follows the checkpoint (AutoAWQ config, BitNet architecture);
    int4/bitnet on a float checkpoint quantize it at load (RTN g128 / absmean)."""
    pack_cpu_linears: bool = True
    """On CPU in float32, keep each linear's weight also in MKL's packed layout: decode steps of 6 to
    16 sequences run faster, at the cost of a second copy of the weights (engine/layers/packed_linear.py)."""
    speculative: str = "ngram"
    """ngram | off: n-gram (prompt-lookup) speculative decoding (engine/core/speculative.py)."""
    num_speculative_tokens: int = 4
    """Most draft tokens proposed per sequence per step. 4, not 8, since the C kernels made a one-row
    step 2.6x faster: verifying rows became dearer relative to it (docs/engine.md, speculation)."""
    ngram_min: int = 2
    """Shortest suffix n-gram looked up in the sequence's earlier tokens."""
    ngram_max: int = 4
    """Longest suffix n-gram tried first."""
    speculative_max_batch: int | None = None
    """Steps with more running sequences than this do not speculate (verification would cost more).
    None: 3 on CPU, where a draft row is compute (a 2-core AVX2 EPYC ran 4 streams of chat at
    0.92-0.95x with drafts, 3 streams at 1.02-1.03x: docs/engine.md, speculation), and 4 on CUDA."""

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, not {self.device!r}")
        if self.cpu_kernels not in ("auto", "c", "torch"):
            raise ValueError(f"cpu_kernels must be auto, c or torch, not {self.cpu_kernels!r}")
        if not 1 <= self.thinking_budget_chars <= 2048:
            raise ValueError("thinking_budget_chars must be between 1 and 2048")
        if self.tool_call_parser not in ("auto", "hermes", "llama3_json"):
            raise ValueError(
                f"tool_call_parser must be auto, hermes or llama3_json: {self.tool_call_parser!r}"
            )
        if self.quant not in ("auto", "none", "int4", "bitnet"):
            raise ValueError(f"quant must be auto, none, int4 or bitnet, not {self.quant!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError("num_kv_blocks must be positive")
        if self.speculative not in ("ngram", "off"):
            raise ValueError(f"speculative must be ngram or off, not {self.speculative!r}")
        if self.num_speculative_tokens < 1 or not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need num_speculative_tokens >= 1 and 1 <= ngram_min <= ngram_max")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_events_port is not None and not self.enable_prefix_cache:
            raise ValueError("KV events report the prefix cache: --kv-events-port needs it on")
        for port in (self.kv_events_port, self.kv_events_replay_port):
            if port is not None and not 0 <= port < 65535:
                raise ValueError(f"KV event ports must be in 0..65534 (0: any free one), not {port}")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for but no CUDA device is available")
        return torch.device(self.device)

    def resolved_speculative_max_batch(self, device: torch.device) -> int:
        if self.speculative_max_batch is not None:
            return self.speculative_max_batch
        return 3 if device.type == "cpu" else 4

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" or self.cpu_bf16_kernels() else torch.float32
        return getattr(torch, self.dtype)

    def cpu_bf16_kernels(self) -> bool:
        """Whether the CPU fast path computes in bf16 on torch's kernels rather than in float32 on the C
        kernels: only with native bf16 (emulated, bf16 is slower than float32), and only where asked
        (``torch``) or where the C kernels cannot serve (not a GGUF or a BitNet checkpoint, no C
        compiler). On an AMX Xeon the C kernels served the default GGUF 2.3-2.4x faster than torch's
        bf16 kernels at one stream and 1.3-1.5x at 16 (docs/engine.md, "On an Intel Xeon with AMX")."""
        if self.cpu_kernels == "c" or not cpu_has_native_bf16():
            return False
        if self.cpu_kernels == "torch":
            return True
        gguf = self.model is None or Path(self.model).suffix == ".gguf"
        return not ((gguf or self._bitnet_checkpoint()) and cpu_kernels.available())

    def _bitnet_checkpoint(self) -> bool:
        """A BitNet checkpoint directory (its config.json as engine/layers/quant/checkpoint.py reads it):
        its ternary weights run on the C kernels' ternary kernel (two bits a weight) rather than torch's
        int8 ``_int_mm`` in bf16."""
        try:
            config = json.loads((Path(self.model or "") / "config.json").read_text())
        except (OSError, ValueError):
            return False
        method = (config.get("quantization_config") or {}).get("quant_method")
        return method == "bitnet" or "BitNetForCausalLM" in (config.get("architectures") or [])

    def resolved_num_threads(self, *, steps_in_c: bool = False) -> int:
        if self.num_threads:
            return self.num_threads
        if (env := os.environ.get("OMP_NUM_THREADS", "")).isdigit() and int(env) > 0:
            return int(env)
        return default_num_threads(steps_in_c=steps_in_c)


KV_TOKENS_PER_SEQ = 64
"""Cache tokens per sequence slot when ``kv_cache_gib`` is None: with 64 slots the pool holds at least
4,096 tokens (llama.cpp's smallest fitted context, Ollama's default), else the model's context or
``--max-model-len`` (8,192 tokens for the default model, 180 MiB in float16), so ``--max-model-len N``
sizes it as llama-server's ``-c N`` does. Short chats fit many times over; the scheduler preempts when
it runs out. It was 128 (8,192 at least): a model of 4,096 tokens' context (bitnet-b1.58-2B-4T) then
had twice llama-server's cache resident after a 64-request run (docs/engine.md, "Memory")."""


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 GEMMs run natively (without them oneDNN emulates bf16, slower than fp32)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def default_num_threads(*, steps_in_c: bool = False) -> int:
    """Physical cores this process may use; one fewer (at least one) unless decode steps run in C.

    OpenMP threads spin at every barrier, so a GEMM split over threads runs at the pace of the one
    that was preempted. Where a step is Python and torch ops holding the GIL (the bf16 and the exact
    paths), the HTTP event loop, detokenization and a co-located client need a core of their own,
    and one thread fewer measured faster. Where a decode step is one C call (``steps_in_c``: the C
    kernels' path), the GIL is free for the whole step, and every core computing measured faster
    even with the client on the same cores (docs/engine.md, "CPU threads").
    """
    cores = available_physical_cores()
    return cores if steps_in_c else max(1, cores - 1)


def available_physical_cores() -> int:
    """Distinct physical cores among the CPUs this process may run on, capped by a cgroup CPU quota."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:  # no sysfs topology: count logical CPUs
            cores.add((str(cpu), ""))
    count = len(cores) or 1
    try:  # cgroup v2: "max 100000" or "<quota> <period>"
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            count = min(count, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return count
