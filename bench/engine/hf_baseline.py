"""Hugging Face transformers ``generate`` on the engine's default model and benchmark prompts.

    python -m bench.engine.hf_baseline --num-requests 16 --max-tokens 64 [--model PATH.gguf]

Two figures, printed as one JSON line: the prompts one at a time, and all of them as
one left-padded batch. Greedy, exactly ``--max-tokens`` new tokens per prompt (eos
ignored), float32 on CPU, the same as ``bench.engine.serving`` asks of the engine.
Each figure also comes per CPU second of this process, which the machine's load
moves far less than wall-clock time (compare with ``serving.py --engine-pid``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from bench.engine import PROMPTS


def load(path: Path):  # -> (model, tokenizer)
    """transformers' own GGUF dequantization, without ``from_pretrained(gguf_file=...)``'s
    dependency on ``accelerate`` (which this project does not install)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    model.tie_weights()
    return model.eval(), tokenizer


@torch.inference_mode()
def generate(model, tokenizer, prompts: list[str], max_tokens: int) -> int:
    """Generate for ``prompts`` as one batch; return the number of new tokens."""
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(
        **batch,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    return (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="GGUF file (default: the SmolLM2 GGUF the engine serves)")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from engine.loader import default_model_path

        args.model = default_model_path()
    model, tokenizer = load(args.model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_requests)]
    generate(model, tokenizer, prompts[:1], 4)  # warm-up

    load_avg = os.getloadavg()[0]
    start, cpu_start = time.perf_counter(), time.process_time()
    tokens = sum(generate(model, tokenizer, [prompt], args.max_tokens) for prompt in prompts)
    sequential_s, sequential_cpu = time.perf_counter() - start, time.process_time() - cpu_start

    start, cpu_start = time.perf_counter(), time.process_time()
    batch_tokens = generate(model, tokenizer, prompts, args.max_tokens)
    batch_s, batch_cpu = time.perf_counter() - start, time.process_time() - cpu_start

    print(
        json.dumps(
            {
                "model": str(args.model),
                "num_requests": args.num_requests,
                "max_tokens": args.max_tokens,
                "threads": torch.get_num_threads(),
                "one_at_a_time_output_tokens_per_s": round(tokens / sequential_s, 2),
                "one_at_a_time_duration_s": round(sequential_s, 3),
                "padded_batch_output_tokens_per_s": round(batch_tokens / batch_s, 2),
                "padded_batch_duration_s": round(batch_s, 3),
                "one_at_a_time_output_tokens_per_cpu_s": round(tokens / sequential_cpu, 2),
                "padded_batch_output_tokens_per_cpu_s": round(batch_tokens / batch_cpu, 2),
                "load_avg_1m": round(load_avg, 2),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
