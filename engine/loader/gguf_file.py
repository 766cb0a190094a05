"""GGUF files: metadata as a dict, and tensors under Hugging Face names, dequantized to float or
kept as their raw blocks: Q4_0/Q4_1 linears under ``--quant int4`` (and TQ1_0/TQ2_0 ones on the CPU
fast path), and (``keep_blocks``, the C kernels' path) every linear, embedding and output head whose
type runs in its own blocks (``engine/cpu/ggml_kernels.py``), plus an untied embedding of any
quantized type.

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from engine.cpu import ggml_kernels
from engine.families import FAMILIES, family_for_gguf
from engine.layers.quant.checkpoint import GGUF_INT4_SUFFIXES, GGUF_TERNARY_SUFFIXES
from engine.loader.gguf_reader import GgufFile, GgufTensor
from engine.model_config import CONFIG_TENSORS, ROPE_FREQS_TENSOR

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
# GGML type name -> the name suffix its raw blocks are passed on under (see QuantizedTensors).
_FLOAT_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
_INT4_SUFFIX_BY_TYPE = {type_name: suffix for suffix, type_name in GGUF_INT4_SUFFIXES.items()}
_TERNARY_SUFFIX_BY_TYPE = {type_name: suffix for suffix, type_name in GGUF_TERNARY_SUFFIXES.items()}


BLOCKS_SUFFIX = ".ggml_blocks_"
"""``<module><BLOCKS_SUFFIX><GGML type name>``: a tensor's raw blocks, kept for its own kernel."""


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


def rope_freq_factors(reader: GgufFile) -> list[float] | None:
    """The values of the file's ``rope_freqs`` tensor (Llama 3.1's rope scaling), None without one.
    They go into the model's config, not its weights: :func:`iter_tensors` skips the tensor."""
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            return [float(v) for v in dequantize(tensor).reshape(-1)]
    return None


def config_tensors(reader: GgufFile) -> dict[str, list[float]]:
    """The file's ``CONFIG_TENSORS`` (Phi-3's LongRoPE factors) as lists, by name: configuration,
    which :func:`iter_tensors` skips."""
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


def _kept_blocks(tensor: GgufTensor, name: str, tied: bool) -> bool:
    """Whether the C kernels' path keeps this tensor as its blocks (``keep_blocks``)."""
    ggml_type, width = tensor.tensor_type, int(tensor.shape[0])
    runs = ggml_kernels.kernel_format(ggml_type, width) is not None
    if name == "model.embed_tokens.weight":  # untied, only rows are looked up: any quantized type
        return runs or (not tied and ggml_type not in _FLOAT_TYPES)
    return runs and (name == "lm_head.weight" or (".layers." in name and name.endswith("_proj.weight")))


def iter_tensors(
    reader: GgufFile,
    architecture: str,
    num_heads: int,
    num_kv_heads: int,
    *,
    keep_int4: bool = False,
    keep_ternary: bool = False,
    keep_blocks: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor in the file.

    With ``keep_int4``, each decoder linear stored as Q4_0/Q4_1 comes instead as its raw blocks,
    uint8 ``[N, K/32 * block bytes]``, named ``<module>.gguf_q4_0`` / ``.gguf_q4_1``: the loader
    builds ``Int4Linear`` modules from them without going through float. With ``keep_ternary``, so
    does each TQ1_0/TQ2_0 one (``.gguf_tq1_0`` / ``.gguf_tq2_0``), for the ternary C kernel. With
    ``keep_blocks``, the tensors :func:`_kept_blocks` picks come as their blocks too, as views of the
    file, named ``<module>.ggml_blocks_<type>`` (``engine/layers/ggml_linear.py`` runs them).
    """
    permuted = family_for_gguf(architecture).gguf_qk_permuted
    tied = "output.weight" not in {t.name for t in reader.tensors}
    for tensor in reader.tensors:
        if tensor.name in CONFIG_TENSORS:
            continue  # read into the config (rope_freq_factors, config_tensors)
        name = hf_tensor_name(tensor.name, architecture)
        type_name = tensor.tensor_type.name
        packed_suffix = (_INT4_SUFFIX_BY_TYPE.get(type_name) if keep_int4 else None) or (
            _TERNARY_SUFFIX_BY_TYPE.get(type_name) if keep_ternary else None
        )
        kept = keep_blocks and _kept_blocks(tensor, name, tied)
        if kept:
            values = np.asarray(tensor.data)  # rows of blocks; permuting rows moves whole blocks
            name = name.removesuffix(".weight") + BLOCKS_SUFFIX + type_name
        elif packed_suffix is not None and ".layers." in name and name.endswith("_proj.weight"):
            values = np.array(tensor.data)  # rows of blocks, a copy: converted by the loader
            name = name.removesuffix(".weight") + packed_suffix
        else:
            values = dequantize(tensor)
        if permuted and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = num_heads if ".attn_q." in tensor.name else num_kv_heads
            if kept:  # in place: the rows become this process's own pages of the mapping
                values[...] = unpermute_rope_rows(values, heads)
            else:
                values = unpermute_rope_rows(values, heads)
        if not kept:
            _release(reader, tensor)
        yield name, torch.from_numpy(values if values.flags.writeable else values.copy())
