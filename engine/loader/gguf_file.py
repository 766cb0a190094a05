"""GGUF files: metadata as a dict, tensor headers under Hugging Face names (what the load plan,
``engine/loader/plan.py``, decides from), and the tensors themselves as their plan says: dequantized
to float or kept as their raw blocks.

The file is mapped copy-on-write: blocks kept are views of the mapping (no copy; what the kernels'
layout rearranges in place becomes the process's own pages), and the pages of every tensor that was
converted instead (dequantized or packed) are handed back as soon as it is, so loading holds about
one copy of the file.

llama.cpp's converter permutes the rows of Llama's (and SmolLM3's: ``Family.gguf_qk_permuted``) q/k
projections so its interleaved-pair RoPE matches HF's rotate-half RoPE. We undo that here, so the
model keeps HF's rotary layout and its logits match transformers on the same file.
"""

from __future__ import annotations

import mmap
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from engine.families import FAMILIES
from engine.loader.gguf_reader import GgufFile, GgufTensor
from engine.loader.plan import Form, PlannedTensor, TensorHeader, TensorPlan
from engine.model_config import CONFIG_TENSORS

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Each family's names: Llama's, with its own added or in their place (Gemma 3's ffn_norm).
_FAMILY_LAYER_NAMES = {
    family.gguf_architecture: _LAYER_NAMES | dict(family.gguf_layer_tensors) for family in FAMILIES
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def open_gguf(path: str | Path) -> GgufFile:
    return GgufFile(path, "c")  # copy-on-write: writable views, the file never written


def _release(reader: GgufFile, tensor: GgufTensor) -> None:
    """Drop the whole pages of ``tensor``'s bytes from this process (converted: never read again)."""
    page = mmap.PAGESIZE
    mapped = getattr(reader.data, "_mmap", None)
    if mapped is None or not hasattr(mapped, "madvise"):
        return
    start = -(-int(tensor.data_offset) // page) * page
    end = (int(tensor.data_offset) + int(tensor.n_bytes)) // page * page
    if end > start:
        mapped.madvise(mmap.MADV_DONTNEED, start, end - start)


def read_metadata(reader: GgufFile) -> dict[str, Any]:
    """Every key/value in the file, as Python values (strings, numbers, lists)."""
    return reader.metadata()


def config_tensors(reader: GgufFile) -> dict[str, list[float]]:
    """The file's ``CONFIG_TENSORS`` (Llama 3.1's ``rope_freqs``, Phi-3's LongRoPE factors) as lists, by
    name: they go into the model's config, not its weights, and the load plan skips them (``Form.CONFIG``)."""
    return {
        t.name: [float(v) for v in dequantize(t).reshape(-1)]
        for t in reader.tensors
        if t.name in CONFIG_TENSORS
    }


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (in ``architecture``'s names)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _FAMILY_LAYER_NAMES.get(architecture, _LAYER_NAMES)
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's `permute`: per head, rows (pair, half) go back to (half, pair)."""
    rows = weight.shape[0]
    half_dim = rows // num_heads // 2
    w = weight.reshape(num_heads, half_dim, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def dequantize(tensor: GgufTensor) -> np.ndarray:
    """A tensor as float32 in PyTorch's (out_features, in_features) order."""
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"tensor {tensor.name!r} has GGML type {tensor.tensor_type.name}, which cannot be dequantized"
        ) from None
    shape = tuple(reversed([int(n) for n in tensor.shape]))
    return np.asarray(values, dtype=np.float32).reshape(shape)


def headers(reader: GgufFile, architecture: str) -> list[TensorHeader]:
    """What the load plan reads of each tensor (``engine/loader/plan.py``): never its data."""
    return [
        TensorHeader(
            t.name,
            t.name if t.name in CONFIG_TENSORS else hf_tensor_name(t.name, architecture),
            t.tensor_type,
            int(t.shape[0]),
        )
        for t in reader.tensors
    ]


def iter_tensors(reader: GgufFile, plans: Mapping[str, TensorPlan]) -> Iterator[PlannedTensor]:
    """Every tensor of the file as its plan says (``plan.gguf_plan``), in the file's order.

    ``FLOAT``: dequantized to float32. ``INT4_BLOCKS`` / ``TERNARY_BLOCKS``: a copy of the raw blocks,
    uint8 ``[N, K/32 * block bytes]``, converted by the loader. ``GGML_BLOCKS``: the blocks as views
    of the file (``engine/layers/ggml_linear.py`` runs them). ``Q4_KERNEL``: views of the file too,
    which the loader lays out before it takes the next tensor; their pages are then handed back.
    ``CONFIG`` tensors are skipped.
    """
    for tensor in reader.tensors:
        plan = plans[tensor.name]
        if plan.form is Form.CONFIG:
            continue  # read into the config (rope_freq_factors, config_tensors)
        kept = plan.form is Form.GGML_BLOCKS
        if kept or plan.form is Form.Q4_KERNEL:
            values = np.asarray(tensor.data)  # rows of blocks; permuting rows moves whole blocks
        elif plan.form is Form.FLOAT:
            values = dequantize(tensor)
        else:
            values = np.array(tensor.data)  # rows of blocks, a copy: converted by the loader
        if plan.permuted_heads is not None:
            if kept:  # in place: the rows become this process's own pages of the mapping
                values[...] = unpermute_rope_rows(values, plan.permuted_heads)
            else:
                values = unpermute_rope_rows(values, plan.permuted_heads)
        yield PlannedTensor(plan, torch.from_numpy(values if values.flags.writeable else values.copy()))
        if not kept:  # after the loader took what it keeps (Q4_KERNEL: laid out from the view, at once)
            _release(reader, tensor)
