"""INT4 quality: perplexity of a model quantized with RTN and AWQ at each group size, against float.

    python -m bench.engine.int4_quality --eval-file tests/data/pride_and_prejudice_ch1.txt \\
        [--model M] [--calib-file F] [--methods rtn awq] [--group-sizes 32 64 128] [--distill N] \\
        [--seed S] [--threads 1]

Prints one JSON line. The evaluation text is scored in windows of the model's context (one window
when it fits). AWQ calibrates on ``--calib-file`` (default: the text ``tern quantize`` uses), cut
into sequences of ``--calib-seq-len`` tokens, as ``tests/engine/test_int4_quality.py`` does.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from bench.engine import cpu_model
from engine.layers.quant.awq import awq_quantize
from engine.layers.quant.distill import distill_int4_scales
from engine.layers.quant.swap import quantize_linears
from engine.loader.load import LoadedModel, load_model
from engine.quantize import (
    DISTILL_SEQ_LEN,
    GROUP_SIZES,
    METHODS,
    calibration_ids,
    default_calibration_text,
    generated_sequences,
)


@torch.no_grad()
def perplexity(model: nn.Module, ids: torch.Tensor, window: int) -> float:
    """exp of the mean next-token loss over ``ids``, scored in consecutive windows of ``window`` tokens."""
    losses: list[torch.Tensor] = []
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        logits = model.compute_logits(model(chunk, torch.arange(len(chunk))))
        losses.append(torch.nn.functional.cross_entropy(logits[:-1], chunk[1:], reduction="none"))
    return torch.exp(torch.cat(losses).mean()).item()


def quantized_copy(loaded: LoadedModel, method: str, group_size: int, calibration: torch.Tensor) -> nn.Module:
    """A copy of ``loaded.model`` with every decoder linear INT4 (``calibration [S, L]`` feeds AWQ)."""
    model = copy.deepcopy(loaded.model)
    if method == "rtn":
        quantize_linears(model, "int4", group_size=group_size)
    else:
        awq_quantize(model, calibration, group_size)
    return model


def distilled_copy(
    loaded: LoadedModel, quantized: nn.Module, calibration: torch.Tensor, generated: Sequence[torch.Tensor]
) -> nn.Module:
    """A copy of the INT4 ``quantized`` with its scales distilled from ``loaded.model`` on the
    ``generated`` sequences and the calibration ones, as ``tern quantize --distill`` does."""
    model = copy.deepcopy(quantized)
    distill_int4_scales(model, loaded.model, [*generated, *calibration])
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF directory or GGUF file (default: the built-in SmolLM2 GGUF)")
    p.add_argument("--eval-file", type=Path, required=True, help="the text whose perplexity is measured")
    p.add_argument("--calib-file", type=Path, help="AWQ calibration text (default: tern quantize's)")
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--group-sizes", nargs="+", type=int, choices=GROUP_SIZES, default=[128])
    p.add_argument(
        "--distill",
        type=int,
        metavar="N",
        help="also report AWQ with scales distilled on N generated sequences plus the calibration text "
        "(tern quantize --distill N; 0: the calibration text only)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated distillation sequences")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(args.model, "cpu", torch.float32, progress=False, quant="none")
    window = loaded.config.max_position_embeddings
    eval_ids = torch.tensor(loaded.tokenizer.encode(args.eval_file.read_text(encoding="utf-8")))
    calib_text = default_calibration_text() if args.calib_file is None else args.calib_file.read_text("utf-8")
    calibration = calibration_ids(loaded.tokenizer, calib_text, args.calib_seq_len)
    baseline = perplexity(loaded.model, eval_ids, window)
    distill = args.distill is not None
    methods = list(dict.fromkeys([*args.methods, *(["awq"] if distill else [])]))
    started = time.perf_counter()
    generated = generated_sequences(loaded, count=args.distill, seed=args.seed) if args.distill else []
    generation_s = time.perf_counter() - started
    results = []

    def record(name: str, group_size: int, model: nn.Module, seconds: float) -> None:
        ppl = perplexity(model, eval_ids, window)
        results.append(
            {
                "method": name,
                "group_size": group_size,
                "perplexity": round(ppl, 3),
                "vs_float_pct": round(100 * (ppl / baseline - 1), 2),
                "quantize_s": round(seconds, 1),
            }
        )

    for group_size in args.group_sizes:
        for method in methods:
            started = time.perf_counter()
            model = quantized_copy(loaded, method, group_size, calibration)
            record(method, group_size, model, time.perf_counter() - started)
            if method == "awq" and distill:
                started = time.perf_counter()
                tuned = distilled_copy(loaded, model, calibration, generated)
                record("awq+distill", group_size, tuned, time.perf_counter() - started)
    report = {
        "model": str(loaded.path),
        "eval_file": str(args.eval_file),
        "eval_tokens": len(eval_ids),
        "calibration": list(calibration.shape),
        "distill_generated": [len(generated), DISTILL_SEQ_LEN] if distill else None,
        "seed": args.seed,
        "generation_s": round(generation_s, 1) if distill else None,
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "float_perplexity": round(baseline, 3),
        "results": results,
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
