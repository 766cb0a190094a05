"""Tensors from a Hugging Face directory's `*.safetensors`, sharded (with an index json) or not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files: those the index names, else every `*.safetensors` in the directory."""
    index = directory / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"weight files named by {INDEX_FILE} are missing: {', '.join(missing)}")
    return files


def count_tensors(files: list[Path]) -> int:
    total = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            total += len(f.keys())
    return total


def iter_tensors(files: list[Path], norm_offset: float = 0.0) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor, one at a time so peak memory stays near one tensor;
    ``norm_offset`` added to every ``*norm.weight`` (Gemma's ``1 + w``: ``Family.hf_norm_offset``)."""
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if norm_offset and name.endswith("norm.weight"):
                    tensor = tensor.float() + norm_offset
                yield name, tensor
