"""Linears and embeddings on a GGUF tensor's own blocks (docs/engine.md, "GGUF types").

``GgmlLinear`` runs the C kernel of its GGML type (``engine/cpu/ggml_kernels.py``, ``KERNEL_TYPES``)
on the file's blocks: the K-quants as they are (or tile by tile), Q8_0 and Q5_0 tile by tile on int8
activations where the CPU has AVX2 (``engine/cpu/q8_0_tiles.py``), else split in place into codes and
scales for the int16 row-by-row tiles. ``GgmlEmbedding`` looks rows up in the same blocks and
dequantizes only them, so no float32 table exists beside them, tied or not. ``StackedLinear`` puts
q/k/v or gate/up side by side, each part on its own kernel (a Q4_K_M file's v_proj is Q6_K in some
layers, Q4_K in others).
"""

from __future__ import annotations

from collections.abc import Sequence

import gguf
import numpy as np
import torch
from torch import nn

from engine.cpu import ggml_kernels, q8_0_tiles
from engine.cpu import kernels as cpu_kernels
from engine.cpu.ggml_kernels import GGMLType
from engine.layers.quant.linear import Int4Linear

_DEQUANTIZED_FROM_TILES = frozenset({GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q5_0})
"""Tiled types whose rows an embedding reads from the tiles (the others' tied heads stay rows of blocks)."""
HEADS_ON_INT16_ROWS = frozenset({GGMLType.Q8_0, GGMLType.Q5_0})
"""Output heads of these types keep int16 activations (the row-by-row tiles' rows, one scale a row) where
the CPU has the int8 tiles: the default model's tied Q8_0 head on int8 rows (llama.cpp's Q8_0 blocks)
kept its perplexity (18.916 against float32's 18.907; 18.906 on int16) but flipped the first greedy token
of "What is the capital of France?" (test_cpu_fast_path.py: "L'Étoile, ..." for "Paris"): a head's
output is the token's choice, its near-ties decided by the rows' precision. The decoder linears take the
int8 tiles (docs/engine.md)."""
HEADS_ON_TILES = frozenset({GGMLType.Q8_0})
"""Of :data:`HEADS_ON_INT16_ROWS`, the heads that run tile by tile on those int16 rows
(``q8_0_tiles.matmul_head``, q8_0_head_tiles.c: the int8 tiles' layout, so a tied head's embedding rows
come from the same tiles); Q5_0 heads (rare) stay on the row-by-row tiles."""
_Q8_0_TILED = frozenset({ggml_kernels.Q8_0_TILED.name, ggml_kernels.Q5_0_TILED.name})


class GgmlLinear(nn.Module):
    """Drop-in for a float32 CPU ``nn.Linear`` whose weight is GGUF blocks of a type with a kernel."""

    def __init__(
        self,
        blocks: torch.Tensor,
        ggml_type: GGMLType,
        in_features: int,
        bias: torch.Tensor | None = None,
        *,
        rows_looked_up: bool = False,
        tile: bool = True,
        head: bool = False,
    ) -> None:
        """``blocks`` are consumed: rearranged in place into the kernel's layout (Q8_0's split, Q4_K's
        tiles). ``rows_looked_up``: an embedding reads rows of it too (a tied head), so its rows stay
        rows of GGUF blocks. ``head``: the output head (:data:`HEADS_ON_INT16_ROWS`)."""
        super().__init__()
        spec = ggml_kernels.kernel_format(ggml_type, in_features)
        if spec is None:
            raise cpu_kernels.KernelError(f"no C kernel runs {ggml_type.name} rows of {in_features}")
        self.ggml_type, self.format = ggml_type, spec.name
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.scales: torch.Tensor | None = None
        self.int16_head = head and ggml_type in HEADS_ON_INT16_ROWS
        """An output head on int16 rows: tile by tile (:data:`HEADS_ON_TILES`) or row by row."""
        tiled = (
            tile
            and not (self.int16_head and ggml_type not in HEADS_ON_TILES)
            and ggml_kernels.tiles(ggml_type, blocks.shape[0])
            and (ggml_type in _DEQUANTIZED_FROM_TILES or not rows_looked_up)
        )
        if tiled and ggml_type in ggml_kernels.ANY_ROWS:
            # Q8_0 and Q5_0: tile by tile on int8 activations (a tied head's rows dequantized from them)
            self.qweight, self.format = (
                q8_0_tiles.tile(blocks, ggml_type),
                ggml_kernels.TILED_FORMATS[ggml_type].name,
            )
        elif tiled:
            # tile by tile for the K-quant tiles (a tied Q6_K head's rows are dequantized from its tiles)
            self.qweight, self.format = (
                ggml_kernels.tile(blocks, ggml_type),
                ggml_kernels.TILED_FORMATS[ggml_type].name,
            )
        elif ggml_type == GGMLType.Q5_0:
            self.qweight, self.scales = ggml_kernels.q5_0_from_blocks(blocks)
        elif ggml_type == GGMLType.Q8_0:
            self.qweight, self.scales = ggml_kernels.q8_0_from_blocks(blocks)
        else:
            self.qweight = blocks
        self.bias = None if bias is None else bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.format in _Q8_0_TILED and self.int16_head:
            out = q8_0_tiles.matmul_head(rows, self.qweight)
        elif self.format in _Q8_0_TILED:
            out = q8_0_tiles.matmul(rows, self.qweight, self.ggml_type)
        elif self.ggml_type == GGMLType.Q5_0:
            assert self.scales is not None
            out = ggml_kernels.matmul_q5_0(rows, self.qweight, self.scales)
        elif self.scales is not None:
            out = cpu_kernels.matmul_q8_0(rows, self.qweight, self.scales)
        elif self.qweight.dim() == 3:  # tile by tile
            out = ggml_kernels.matmul_tiled(rows, self.qweight, self.ggml_type)
        else:
            out = ggml_kernels.matmul_kquant(rows, self.qweight, self.ggml_type)
        if self.bias is not None:
            out += self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight in float32 (the embedding lookup of a tied head)."""
        if self.format in _Q8_0_TILED:
            return q8_0_tiles.dequantize_rows(self.qweight, self.ggml_type, ids)
        if self.ggml_type == GGMLType.Q5_0:
            assert self.scales is not None
            flat = ids.reshape(-1)
            blocks = ggml_kernels.q5_0_blocks(self.qweight[flat], self.scales[flat])
            return dequantize_rows(blocks, GGMLType.Q5_0, torch.arange(flat.numel())).reshape(*ids.shape, -1)
        if self.scales is not None:
            # index_select, not ``qweight[ids]``: the same rows, without a parallel region per lookup
            # (milliseconds a decode step on a loaded 2-core machine, microseconds this way).
            flat = ids.reshape(-1)
            codes, scales = self.qweight.index_select(0, flat), self.scales.index_select(0, flat)
            rows = (codes.float().unflatten(-1, (-1, 32)) * scales.float().unsqueeze(-1)).flatten(-2)
            return rows.reshape(*ids.shape, -1)
        if self.qweight.dim() == 3:
            return ggml_kernels.dequantize_q6_k_tiled(self.qweight, ids)
        return dequantize_rows(self.qweight, self.ggml_type, ids)

    def extra_repr(self) -> str:
        rows = ", int16 rows" if self.int16_head else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}{rows}"


def dequantize_rows(blocks: torch.Tensor, ggml_type: GGMLType, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape) of a tensor of GGUF blocks, dequantized by gguf, float32 [*ids, K]."""
    flat = ids.reshape(-1)
    rows = blocks[flat].numpy()
    values = np.asarray(gguf.quants.dequantize(rows, ggml_type), dtype=np.float32)
    return torch.from_numpy(values.reshape(*ids.shape, -1))


class GgmlEmbedding(nn.Module):
    """Drop-in for ``nn.Embedding`` over GGUF blocks: a tied head's (``GgmlLinear``), or the file's
    token_embd of any type gguf dequantizes. A looked-up row is what the float table would hold."""

    dtype = torch.float32

    def __init__(self, source: GgmlLinear | tuple[torch.Tensor, GGMLType], embedding_dim: int) -> None:
        super().__init__()
        self.head = source if isinstance(source, GgmlLinear) else None
        self.blocks: torch.Tensor | None = None if isinstance(source, GgmlLinear) else source[0]
        self.ggml_type: GGMLType | None = None if isinstance(source, GgmlLinear) else source[1]
        rows = source.out_features if isinstance(source, GgmlLinear) else source[0].shape[0]
        self.num_embeddings, self.embedding_dim = rows, embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            return self.head.dequantized_rows(ids)
        assert self.blocks is not None and self.ggml_type is not None
        return dequantize_rows(self.blocks, self.ggml_type, ids)

    def extra_repr(self) -> str:
        kind = self.head.format if self.head is not None else self.ggml_type.name  # type: ignore[union-attr]
        return f"{self.num_embeddings}, {self.embedding_dim}, format={kind}"


class StackedLinear(nn.Module):
    """Linears that read one input, side by side in the output, each on its own kernel: q/k/v or
    gate/up whose GGUF types differ (one weight cannot hold them). The C decoder layer runs them as
    a chain of parts (decoder_layer.h, ``TernLinear.next``)."""

    format = "stacked"

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features: int = int(parts[0].in_features)  # type: ignore[arg-type]
        self.out_features: int = sum(int(p.out_features) for p in parts)  # type: ignore[arg-type, misc]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def stack_ggml_linears(
    parts: Sequence[nn.Module], kinds: tuple[type[nn.Module], ...] = (GgmlLinear, Int4Linear)
) -> nn.Module | None:
    """A :class:`StackedLinear` of parts of which some are :class:`GgmlLinear` (the others of
    ``kinds``: a file's Q4_0/Q4_1 blocks as ``Int4Linear``, which become ``Q4CpuLinear`` after, or as
    ``Q4CpuLinear`` already); None where they cannot be stacked (other kinds, widths or biases).
    Never one concatenated weight, even of one type: the parts are views of the file's mapping, and
    a copy would leave their pages resident beside it."""
    if not all(isinstance(p, kinds) for p in parts):
        return None
    if len({p.in_features for p in parts}) != 1 or len({p.bias is None for p in parts}) != 1:
        return None
    return StackedLinear(parts)
