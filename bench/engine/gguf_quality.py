"""A GGUF's quality as the engine serves it against the same file dequantized to float32.

    python -m bench.engine.gguf_quality --model FILE.gguf [--eval-file TEXT] [--threads 1]

Both are engines built as ``tern engine`` builds them: the default config (on CPU with the C kernels,
every linear whose GGML type has a kernel in its own blocks, docs/engine.md "GGUF types") and
``--dtype float32`` (the exact path). Prints one JSON line: each one's perplexity on the evaluation
text (scored in windows of the model's context) and its greedy answer to "What is the capital of
France?" (the issue's gate: perplexity within 1% of float32, and "Paris").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import cast

import torch
from torch import nn

from bench.engine import cpu_model
from bench.engine.int4_quality import perplexity
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.serving.frames import generate_frames
from protocol.rpc import ChatMessage, GenerateRequest, SamplingParams

EVALUATION_TEXT = Path(__file__).resolve().parents[2] / "tests" / "data" / "pride_and_prejudice_ch1.txt"
QUESTION = "What is the capital of France?"


def answer(engine: LLMEngine, max_tokens: int = 16) -> str:
    """The engine's greedy answer to :data:`QUESTION`."""
    request = GenerateRequest(
        request_id="q",
        messages=[ChatMessage(role="user", content=QUESTION)],
        sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens),
    )
    return "".join(f.text for f in generate_frames(engine, [request])["q"] if f.type == "delta")


def measure(model: str, dtype: str, text: str, threads: int) -> dict[str, str | float | int]:
    engine = LLMEngine.from_config(EngineConfig(model=model, device="cpu", dtype=dtype, num_threads=threads))
    ids = torch.tensor(engine.tokenizer.encode(text))
    with torch.no_grad():
        ppl = perplexity(cast(nn.Module, engine.runner.model), ids, engine.runner.max_context)
    return {"dtype": dtype, "perplexity": round(ppl, 4), "answer": answer(engine), "tokens": len(ids)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the GGUF file")
    p.add_argument("--eval-file", type=Path, default=EVALUATION_TEXT)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    text = args.eval_file.read_text(encoding="utf-8")
    served = measure(args.model, "auto", text, args.threads)
    exact = measure(args.model, "float32", text, args.threads)
    change = 100 * (float(served["perplexity"]) / float(exact["perplexity"]) - 1)
    report = {"model": args.model, "cpu": cpu_model(), "served": served, "float32": exact}
    print(json.dumps({**report, "change_pct": round(change, 4)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
