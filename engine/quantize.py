"""``tern quantize``: a float model -> an INT4 (W4A16) checkpoint that the engine loads directly.

Every linear of every decoder layer is quantized group-wise to 4 bits with an integer zero point,
by round-to-nearest (``rtn``) or AWQ (``awq``, calibrated on text); the embedding, the norms and
``lm_head`` stay float. With ``--distill N``, the group scales and norms are then tuned so the
INT4 model's next-token distribution matches the float model's on ``N`` sequences the float model
generates (:mod:`engine.layers.quant.distill`).

The output is an AutoAWQ GEMM directory (``quant_method: awq``), so ``load_model`` /
``tern engine --model DIR`` put the packed weights straight into ``Int4Linear``. Layers AutoAWQ's
layout cannot hold (K not a whole number of groups, N not a multiple of 8) are written padded;
only Tern reads those back. See docs/quantization.md.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import EngineRequest, SamplingParams
from engine.layers.quant import Int4Linear
from engine.layers.quant.awq import awq_quantize
from engine.layers.quant.checkpoint import checkpoint_quant
from engine.layers.quant.distill import distill_int4_scales
from engine.layers.quant.formats import awq_gemm_from_int4
from engine.layers.quant.swap import quantize_linears
from engine.loader.load import LoadedModel, default_model_path, load_model
from engine.loader.progress import ProgressBar
from engine.loader.save import as_stored, save_hf_dir
from engine.tokenizer import Tokenizer

METHODS = ("awq", "rtn")
GROUP_SIZES = (32, 64, 128)
CALIBRATION_SEQ_LEN = 512
"""Tokens per AWQ calibration sequence (the text is cut into as many as it fills)."""
MIN_CALIBRATION_TOKENS = 32
DISTILL_SEQ_LEN = 256
"""Tokens per generated distillation sequence."""
GENERATION_BATCH = 32
"""Sequences generated at once (the engine's batch); the KV cache is sized for exactly these."""
FLOAT_DTYPE = torch.float16
"""What the tensors left in float (embedding, norms, lm_head, biases) are stored as, as AutoAWQ does."""


def default_calibration_text() -> str:
    """The public-domain text shipped in the engine package (Alice in Wonderland, chapter I)."""
    return resources.files("engine").joinpath("data", "calibration.txt").read_text(encoding="utf-8")


def calibration_ids(tokenizer: Tokenizer, text: str, max_len: int) -> torch.Tensor:
    """``[S, L]`` token ids: the text cut into whole sequences of ``L`` tokens (one shorter
    sequence when the text does not fill one)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < MIN_CALIBRATION_TOKENS:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than {MIN_CALIBRATION_TOKENS}")
    seq_len = min(max_len, len(ids))
    count = len(ids) // seq_len
    return torch.tensor(ids[: count * seq_len]).view(count, seq_len)


def generated_sequences(
    loaded: LoadedModel, *, count: int, length: int = DISTILL_SEQ_LEN, seed: int = 0
) -> list[torch.Tensor]:
    """``count`` sequences of ``length`` tokens that ``loaded.model`` samples (temperature 1), each
    from one random word of its vocabulary: data-free distillation data, as in LLM-QAT (Liu et al.,
    2023), that covers what the model itself writes rather than one calibration text."""
    tokenizer = loaded.tokenizer
    length = min(length, loaded.config.max_position_embeddings)
    vocabulary = range(tokenizer.vocab_size)
    words = [i for i in vocabulary if _is_word(tokenizer.decode([i]))] or list(vocabulary)
    rng = random.Random(seed)
    device = loaded.model.lm_head.weight.device
    blocks_per_sequence = -(-length // EngineConfig.block_size)
    engine = LLMEngine(
        EngineConfig(
            device=device.type,
            max_num_seqs=GENERATION_BATCH,
            num_kv_blocks=GENERATION_BATCH * blocks_per_sequence + 1,
            num_threads=torch.get_num_threads(),
        ),
        model=loaded.model,
        tokenizer=tokenizer,
        model_config=loaded.config,
        model_name="distillation-data",
    )
    sampling = SamplingParams(temperature=1.0, max_tokens=length - 1, ignore_eos=True)
    requests = [
        EngineRequest(
            request_id=str(i),
            prompt_token_ids=[rng.choice(words)],
            sampling=dataclasses.replace(sampling, seed=seed * count + i),
        )
        for i in range(count)
    ]
    outputs = engine.generate(requests)
    sequences = []
    for request in requests:
        generated = [t for d in outputs[request.request_id].deltas for t in d.token_ids]
        sequences.append(torch.tensor([*request.prompt_token_ids, *generated][:length], device=device))
    return sequences


def _is_word(text: str) -> bool:
    return text.startswith(" ") and text[1:].isalpha()


@torch.no_grad()
def quantize_model(
    model: str | Path | None,
    *,
    method: str,
    group_size: int = 128,
    device: str = "auto",
    calibration_text: str | None = None,
    distill_sequences: int = 0,
    progress: bool = True,
) -> LoadedModel:
    """Load ``model`` in float and replace its decoder layers' linears by ``Int4Linear``, in place.

    ``distill_sequences > 0`` then tunes the scales on that many generated sequences (plus AWQ's
    calibration text), with a float copy of the model as the teacher.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, not {method!r}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group size must be one of {', '.join(map(str, GROUP_SIZES))}, not {group_size}")
    path = default_model_path() if model is None else Path(model)
    detected, _ = checkpoint_quant(path) if path.exists() else ("none", {})
    if detected != "none":
        raise ValueError(f"{path} is already {detected}-quantized; quantize a float checkpoint")
    if distill_sequences < 0:
        raise ValueError(f"distill_sequences must be >= 0, not {distill_sequences}")
    loaded = load_model(path, device, progress=progress, quant="none")
    teacher, distill_data = None, []
    if distill_sequences:
        if progress:
            print(f"Generating {distill_sequences} sequences to distill from", file=sys.stderr, flush=True)
        distill_data = generated_sequences(loaded, count=distill_sequences, length=DISTILL_SEQ_LEN)
        teacher = copy.deepcopy(loaded.model)
    layers = list(loaded.model.model.layers)
    with _progress(len(layers), f"Quantizing ({method}, g{group_size})", "layers", progress) as layer_done:
        if method == "rtn":
            for layer in layers:
                quantize_linears(layer, "int4", group_size=group_size)
                layer_done()
        else:
            text = default_calibration_text() if calibration_text is None else calibration_text
            max_len = min(CALIBRATION_SEQ_LEN, loaded.config.max_position_embeddings)
            ids = calibration_ids(loaded.tokenizer, text, max_len).to(loaded.model.lm_head.weight.device)
            awq_quantize(loaded.model, ids, group_size, progress=layer_done)
            distill_data += list(ids)
    if teacher is not None:
        with _progress(len(distill_data), "Distilling scales", "sequences", progress) as step_done:
            distill_int4_scales(loaded.model, teacher, distill_data, progress=step_done)
    return loaded


@contextmanager
def _progress(total: int, description: str, unit: str, enabled: bool) -> Iterator[Callable[..., None]]:
    """A callback that advances a progress bar (a no-op when ``enabled`` is false)."""
    bar = ProgressBar(total, description, unit=unit) if enabled else None
    try:
        yield (lambda *_: None) if bar is None else (lambda *_: bar.update())
    finally:
        if bar is not None:
            bar.close()


def checkpoint_tensors(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM ``qweight``/``qzeros``/``scales`` for each ``Int4Linear``, fp16 for the rest (norms
    as the family's checkpoints hold them: ``as_stored``)."""
    model, config = loaded.model, loaded.config
    tensors: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, Int4Linear):
            qweight, qzeros, scales = awq_gemm_from_int4(module.int4_weight())
            tensors |= {f"{name}.qweight": qweight, f"{name}.qzeros": qzeros, f"{name}.scales": scales}
            if module.bias is not None:
                tensors[f"{name}.bias"] = module.bias.to(FLOAT_DTYPE)
    for name, param in model.named_parameters():  # tied lm_head: named once, as the embedding
        tensors[name] = as_stored(name, param.detach(), config).to(FLOAT_DTYPE)
    overflow = [name for name, t in tensors.items() if t.is_floating_point() and not t.isfinite().all()]
    if overflow:
        raise ValueError(f"float16 cannot hold these tensors: {overflow[:3]}")
    return tensors


def awq_quantization_config(group_size: int) -> dict[str, Any]:
    """The ``quantization_config`` AutoAWQ writes for a 4-bit GEMM checkpoint."""
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }


def write_checkpoint(
    loaded: LoadedModel, out: Path, *, method: str, group_size: int, distill_sequences: int = 0
) -> None:
    made_by = f"tern quantize --method {method} --group-size {group_size}"
    if distill_sequences:
        made_by += f" --distill {distill_sequences}"
    save_hf_dir(
        out,
        source=loaded.path,
        config=loaded.config,
        tokenizer=loaded.tokenizer,
        tensors=checkpoint_tensors(loaded),
        config_updates={
            "quantization_config": awq_quantization_config(group_size),
            "torch_dtype": str(FLOAT_DTYPE).removeprefix("torch."),
        },
        metadata={"quantized_by": made_by},
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tern quantize",
        description="Quantize a model's decoder linears to INT4 (W4A16) and write a safetensors "
        "checkpoint that `tern engine --model DIR` loads directly.",
    )
    p.add_argument("--model", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument(
        "--method", choices=METHODS, default="awq", help="awq: activation-aware; rtn: round-to-nearest"
    )
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=128, help="weights per scale/zero")
    p.add_argument("--out", type=Path, required=True, help="output directory (created; must be empty)")
    p.add_argument(
        "--calib-file",
        type=Path,
        help="UTF-8 text that calibrates AWQ (default: a public-domain text shipped with the engine)",
    )
    p.add_argument(
        "--distill",
        type=int,
        default=0,
        metavar="N",
        help="then tune the group scales and norms towards the float model on N sequences it generates "
        f"({DISTILL_SEQ_LEN} tokens each; 128 is a good start; default 0: off)",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to quantize")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.calib_file is not None and args.method != "awq":
        parser.error("--calib-file calibrates AWQ; rtn does not use it")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        parser.error(f"--out {args.out} exists and is not an empty directory")
    if args.distill < 0:
        parser.error("--distill must be >= 0")
    start = time.monotonic()
    try:
        text = args.calib_file.read_text(encoding="utf-8") if args.calib_file is not None else None
        loaded = quantize_model(
            args.model,
            method=args.method,
            group_size=args.group_size,
            device=args.device,
            calibration_text=text,
            distill_sequences=args.distill,
        )
        write_checkpoint(
            loaded, args.out, method=args.method, group_size=args.group_size, distill_sequences=args.distill
        )
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    quantized = sum(isinstance(m, Int4Linear) for m in loaded.model.modules())
    size_mb = sum(f.stat().st_size for f in args.out.iterdir()) / 1e6
    print(
        f"wrote {args.out}: {quantized} INT4 linears ({args.method}, group {args.group_size}), "
        f"{size_mb:.1f} MB, {time.monotonic() - start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
