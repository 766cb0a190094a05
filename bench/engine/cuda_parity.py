"""The CUDA paths' logits against the CPU ones on the same weights.

    python -m bench.engine.cuda_parity --model r1b-f16.gguf

Each pair is two engines built as ``tern engine`` builds them, one on CPU and one on CUDA, scoring
the same text (``--tokens`` of the evaluation text, one forward without a cache) and greedily
continuing three prompts through the paged KV cache. Pairs: float32 against float32 (the same math;
only the kernels differ), bfloat16 on CUDA against float32 on CPU, and INT4 (RTN, group 128) on CUDA's
Triton kernel against the same INT4 codes on the CPU. Prints one JSON object: per pair the largest
logit difference over the logits' spread, the share of positions whose top token agrees, both
perplexities, and how many greedy tokens agree before the first difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any, cast

import torch

from bench.engine.gguf_quality import EVALUATION_TEXT
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.loader import load_tokenizer
from engine.serving.frames import generate_frames
from protocol.rpc import GenerateRequest, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
PAIRS = [
    (("cpu", "float32", "none"), ("cuda", "float32", "none")),
    (("cpu", "float32", "none"), ("cuda", "bfloat16", "none")),
    (("cpu", "auto", "int4"), ("cuda", "bfloat16", "int4")),
]


@dataclass
class Run:
    logits: torch.Tensor
    perplexity: float
    greedy: list[list[int]]


def run(model: str, device: str, dtype: str, quant: str, ids: list[int], max_tokens: int) -> Run:
    engine = LLMEngine.from_config(EngineConfig(model=model, device=device, dtype=dtype, quant=quant))
    net = cast(Any, engine.runner.model)
    chunk = torch.tensor(ids, device=device)
    with torch.no_grad():
        logits = net.compute_logits(net(chunk, torch.arange(len(ids), device=device))).float().cpu()
    loss = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    requests = [
        GenerateRequest(
            request_id=str(i),
            prompt=prompt,
            sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        )
        for i, prompt in enumerate(PROMPTS)
    ]
    frames = generate_frames(engine, requests)
    greedy = [
        [t for f in frames[str(i)] if f.type == "delta" for t in f.token_ids] for i in range(len(PROMPTS))
    ]
    del engine, net
    if device == "cuda":
        torch.cuda.empty_cache()
    return Run(logits, float(torch.exp(loss)), greedy)


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def compare(reference: Run, other: Run) -> dict[str, Any]:
    spread = float(reference.logits.std())
    return {
        "max_abs_diff_over_std": round(float((reference.logits - other.logits).abs().max()) / spread, 5),
        "top1_agreement": round(
            float((reference.logits.argmax(-1) == other.logits.argmax(-1)).float().mean()), 4
        ),
        "perplexity": [round(reference.perplexity, 4), round(other.perplexity, 4)],
        "greedy_tokens_agreeing": [
            agreeing_prefix(a, b) for a, b in zip(reference.greedy, other.greedy, strict=True)
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--device", default="cuda", help="cpu only to try the harness")
    args = p.parse_args(argv)
    text = EVALUATION_TEXT.read_text(encoding="utf-8")
    ids: list[int] | None = None
    report: dict[str, Any] = {"model": args.model, "pairs": []}
    cache: dict[tuple[str, str, str], Run] = {}
    for pair in PAIRS:
        try:
            for key in pair:
                if key not in cache:
                    if ids is None:
                        ids = load_tokenizer(args.model).encode(text)[: args.tokens]
                    device, dtype, quant = key
                    device = args.device if device == "cuda" else device
                    cache[key] = run(args.model, device, dtype, quant, ids, args.max_tokens)
            report["pairs"].append({"pair": pair, **compare(cache[pair[0]], cache[pair[1]])})
        except Exception as error:  # one pair failing must not lose the others
            report["pairs"].append({"pair": pair, "error": repr(error)})
        # Each pair as it is done: a run cut short by a time limit keeps what it measured.
        print(json.dumps(report["pairs"][-1]), file=sys.stderr, flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
