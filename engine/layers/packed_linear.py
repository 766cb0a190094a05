"""CPU linears whose weights are packed once, at load, for the GEMM library that runs them.

``OneDnnPackedLinear`` (bfloat16, the CPU fast path): oneDNN reorders a plain weight into its
blocked layout on every call, which for a decode step's few rows costs more than the arithmetic.
Packed once, the weight replaces the plain one (no second copy), and a one-row linear of
SmolLM2's shapes ran about twice as fast (docs/engine.md, "The CPU fast path"). The packed layout
serves any row count, and a row's result does not depend on the others in the batch.

``MklPackedLinear``: a float32 CPU ``nn.Linear`` that also holds its weight in MKL's packed layout.

MKL's ``sgemm`` re-packs the weight matrix on every call. With the few rows of a decode step that
packing costs more than the arithmetic: on the development CPU a 16-row linear of SmolLM2's shapes
ran 1.6 to 2.5 times faster with a weight packed once, at load (docs/engine.md, "CPU linears").
MKL's packed GEMM serves one row count, so batches of ``MIN_PACKED_ROWS`` to ``PACKED_ROWS`` rows are
padded to ``PACKED_ROWS`` and take it. Smaller ones keep ``F.linear`` (MKL's matrix-vector path is
faster there), and so do larger ones (prefill), whose packing cost is spread over many rows.

The price is a second copy of every weight, so only the engine's loader packs, on CPU
(``EngineConfig.pack_cpu_linears``, ``tern engine --no-pack-cpu-linears``).

Which class replaces which linear is one table, ``engine/loader/linear_factory.py``; each class's
``supports`` says whether it can take a given module (shape rules, the kernel being there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import cpu_has_native_bf16
from engine.cpu import kernels as cpu_kernels
from engine.layers.ggml_linear import GgmlEmbedding
from engine.layers.quant.linear import Int4Linear

PACKED_ROWS = 16
MIN_PACKED_ROWS = 6
"""From 6 rows up, padding to 16 and the packed GEMM beat ``F.linear`` on every shape measured."""


def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


class MklPackedLinear(nn.Module):
    """Drop-in for a float32 CPU ``nn.Linear``; shares the original's weight and bias tensors."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        with torch.no_grad():
            self.packed_weight = torch.ops.mkl._mkl_reorder_linear_weight(linear.weight.detach(), PACKED_ROWS)

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        return mkl_packing_available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        m = rows.shape[0]
        if not MIN_PACKED_ROWS <= m <= PACKED_ROWS:
            return F.linear(x, self.weight, self.bias)
        if m < PACKED_ROWS:
            rows = F.pad(rows, (0, 0, 0, PACKED_ROWS - m))
        out = torch.ops.mkl._mkl_linear(rows, self.packed_weight, self.weight, self.bias, PACKED_ROWS)
        return out[:m].reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed_rows={PACKED_ROWS}"


def onednn_packing_available() -> bool:
    """oneDNN's packed bf16 linears: they refuse a CPU without AVX512 (or AVX-NE-CONVERT), so
    ``--dtype bfloat16`` there keeps plain linears instead of failing at start-up."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and cpu_has_native_bf16()
    )


class OneDnnPackedLinear(nn.Module):
    """Drop-in for a bfloat16 CPU ``nn.Linear`` (weight ``[N, K]``), holding only the oneDNN-packed weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight, bias = linear.weight, linear.bias
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        with torch.no_grad():
            # The row-count hint only picks the layout; every row count runs on it.
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        return onednn_packing_available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn_packed=True"


class Int4PackedCpuLinear(nn.Module):
    """Drop-in for a CPU ``Int4Linear``: torch's weight-only int4 kernel
    (``_weight_int4pack_mm_for_cpu``), which streams the 4-bit weight and computes
    ``(code - 8) * scale + zero``; with ``zero = min + 8 * scale`` that is the layer's own
    ``code * scale + min``.

    The kernel takes bfloat16 rows; in a float32 model (a CPU without native bf16) the rows are
    rounded to bf16 on the way in and the output is float32 again: with float32 rows the kernel
    has no vectorised path and ran 15 times slower (docs/engine.md).

    Every batch size takes this kernel, and it computes each row on its own, so a sequence's tokens do
    not depend on what else is in the batch. A bf16 GEMM on a dequantized copy runs large batches
    (prefill) about three times faster, but its results for a row move with the row count, and
    greedy outputs then differed with the batch (8 of 16 prompts): measured, and not used.
    """

    def __init__(self, linear: Int4Linear) -> None:
        super().__init__()
        weight = linear.int4_weight()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = linear.group_size
        with torch.no_grad():
            codes = weight.codes.to(torch.int32)
            self.int4_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            zeros = weight.mins + 8 * weight.scales
            self.scales_and_zeros = (
                torch.stack((weight.scales.t(), zeros.t()), dim=-1).bfloat16().contiguous()
            )
        self.bias = None if linear.bias is None else linear.bias.bfloat16()

    @staticmethod
    def supports(linear: Int4Linear) -> bool:
        """The kernel's shape rules: whole groups along K, output rows in tiles of 16."""
        return (
            linear.backend == "torch"
            and linear.in_features % linear.group_size == 0
            and linear.group_size in (32, 64, 128, 256)
            and linear.out_features % 16 == 0
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.int4_weight, self.group_size, self.scales_and_zeros
        )
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"
        )


class Int8PackedCpuLinear(nn.Module):
    """Drop-in for a float32 CPU ``nn.Linear`` on a CPU without native bf16 (the tied embedding /
    lm_head of the GGUF, Q8_0): int8 weights with one scale per output row, run by torch's
    weight-only int8 kernel (``_weight_int8pack_mm``) on bf16 rows. A fourth of the float32 weight's
    bytes: on an AVX2 EPYC one row of SmolLM2's lm_head took 3.9 ms instead of 10.5.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            weight = linear.weight.detach().float()
            scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
            self.int8_weight = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
            self.scales = scales.bfloat16()
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int8pack_mm(rows, self.int8_weight, self.scales).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8_per_row=True"


class Q4CpuLinear(nn.Module):
    """Drop-in for a CPU ``Int4Linear`` in a float32 model: the weight as GGUF Q4_1 blocks of 32
    (``code * scale + min``; a larger group repeats its scale and min), run by the C kernel of
    ``engine/cpu`` with each row quantized to int16 on the way in (llama.cpp takes int8 blocks). A
    row's result does not depend on the batch or the thread count (docs/engine.md, "CPU linears")."""

    format = "q4_1"

    def __init__(
        self, linear: Int4Linear | None, *, laid_out: tuple[torch.Tensor, ...] = (), out_features: int = 0
    ) -> None:
        """From an ``Int4Linear`` (AWQ, RTN), or, with ``linear`` None, from ``laid_out``: the kernel's
        (qweight, scales, mins) of ``out_features`` rows, as :meth:`from_gguf_blocks` and
        :meth:`stacked` make them."""
        super().__init__()
        self.bias: torch.Tensor | None = None
        if linear is None:
            self.qweight, self.scales, self.mins = laid_out
            tiled = self.qweight.dim() == 4  # [tiles, K / 32, 8, 32], else [N, K / 2]
            self.in_features = self.qweight.shape[1] * (cpu_kernels.BLOCK if tiled else 2)
            self.out_features = out_features
            return
        weight = linear.int4_weight()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        repeat = weight.group_size // cpu_kernels.BLOCK
        with torch.no_grad():
            # float16, as GGUF stores them (int4_weight() holds them in fp16 precision: no rounding)
            self.scales = weight.scales.repeat_interleave(repeat, dim=1).half().contiguous()
            mins = weight.mins.repeat_interleave(repeat, dim=1).half().contiguous()
            packed = cpu_kernels.pack_q4_1(weight.codes, self.scales, mins)
            # what the kernel reads: the mins tile by tile, codes and scales too in the VNNI build
            self.qweight, self.scales, self.mins = cpu_kernels.q4_1_kernel_layout(packed, self.scales, mins)
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    @classmethod
    def from_gguf_blocks(cls, blocks: torch.Tensor, quant_type: str) -> Q4CpuLinear:
        """A GGUF ``Q4_0``/``Q4_1`` tensor's rows of blocks (uint8 ``[N, K/32 * block bytes]``, not
        kept: may be views of the file) split into the kernel's layout. Q4_1's codes are already in
        it (byte j of a block: element j low, j + 16 high); Q4_0 is Q4_1 with ``min = -8 * d``."""
        header = {"Q4_0": 2, "Q4_1": 4}[quant_type]
        n = blocks.shape[0]
        raw = blocks.reshape(n, -1, header + cpu_kernels.BLOCK // 2)
        scales = raw[..., 0:2].contiguous().view(torch.float16).reshape(n, -1)
        if quant_type == "Q4_0":
            mins = (-8 * scales.float()).half()
        else:
            mins = raw[..., 2:4].contiguous().view(torch.float16).reshape(n, -1)
        packed = raw[..., header:].reshape(n, -1).contiguous()
        return cls(None, laid_out=cpu_kernels.q4_1_kernel_layout(packed, scales, mins), out_features=n)

    @staticmethod
    def stacked(parts: list[Q4CpuLinear]) -> Q4CpuLinear | None:
        """The parts side by side in the output (q/k/v, gate/up), their laid-out weights joined; None
        where a tile would straddle two parts (a part before the last has rows past a whole tile)."""
        straddles = any(p.out_features % cpu_kernels.TILE_N for p in parts[:-1])
        if straddles or len({p.bias is None for p in parts}) != 1:
            return None
        laid_out = tuple(torch.cat([getattr(p, a) for p in parts]) for a in ("qweight", "scales", "mins"))
        stacked = Q4CpuLinear(None, laid_out=laid_out, out_features=sum(p.out_features for p in parts))
        if parts[0].bias is not None:
            stacked.bias = torch.cat([p.bias for p in parts if p.bias is not None])
        return stacked

    @staticmethod
    def supports(linear: Int4Linear) -> bool:
        return (
            linear.backend == "torch"
            and linear.in_features % linear.group_size == 0
            and linear.group_size % cpu_kernels.BLOCK == 0
            and cpu_kernels.available()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = cpu_kernels.matmul_q4_1_laid_out(
            x.reshape(-1, self.in_features), self.qweight, self.scales, self.mins, self.out_features
        )
        if self.bias is not None:
            out += self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


class Q8CpuLinear(nn.Module):
    """Drop-in for a float32 CPU ``nn.Linear`` (the GGUF's tied embedding / lm_head, stored Q8_0):
    int8 weights with a scale per block of 32, which gives a Q8_0 tensor its own codes back, run by
    the C kernel of ``engine/cpu``. A fourth of the float32 weight's bytes."""

    format = "q8_0"

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.qweight, self.scales = cpu_kernels.quantize_q8_0(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        return linear.in_features % cpu_kernels.BLOCK == 0 and cpu_kernels.available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = cpu_kernels.matmul_q8_0(x.reshape(-1, self.in_features), self.qweight, self.scales)
        if self.bias is not None:
            out += self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


class Q8Embedding(nn.Module):
    """Drop-in for a tied ``nn.Embedding`` whose lm_head became a :class:`Q8CpuLinear`: each looked-up
    row is dequantized from the lm_head's Q8_0 blocks (the same tensors, shared), so the float32 table
    is not kept beside them (108 MiB of the default model's 500 MB at start). Only where those blocks
    give the table back exactly (:meth:`represents`: a GGUF's Q8_0 tied embedding), so every input
    row is bit for bit what it was; ``int8 * float16`` is exact in float32."""

    dtype = torch.float32

    def __init__(self, head: Q8CpuLinear) -> None:
        super().__init__()
        self.qweight, self.scales = head.qweight, head.scales
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    @staticmethod
    def represents(head: Q8CpuLinear, table: torch.Tensor, rows_at_once: int = 4096) -> bool:
        """Whether ``head``'s blocks dequantize to ``table`` exactly (checked a slice at a time)."""
        if table.dtype != torch.float32 or table.shape != (head.out_features, head.in_features):
            return False
        for start in range(0, table.shape[0], rows_at_once):
            rows = slice(start, start + rows_at_once)
            if not torch.equal(_dequantize_q8_0(head.qweight[rows], head.scales[rows]), table[rows]):
                return False
        return True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _dequantize_q8_0(self.qweight[ids], self.scales[ids])

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format=q8_0"


class Bf16Embedding(nn.Module):
    """Drop-in for a float32 ``nn.Embedding`` whose every value is a bfloat16 (a bf16 checkpoint's
    table, as an HF BitNet model's): the table kept in bfloat16, half the bytes, and each looked-up row
    widened back to float32, bit for bit what it was (bfloat16 -> float32 is exact). For a tied table
    its head's Q8_0 blocks do not give back (:class:`Q8Embedding`): BitNet 2B-4T's is 503 MB in float32,
    252 MB here."""

    dtype = torch.float32

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table.detach().to(torch.bfloat16)
        self.num_embeddings, self.embedding_dim = self.table.shape

    @staticmethod
    def represents(table: torch.Tensor, rows_at_once: int = 4096) -> bool:
        """Whether every value of the float32 ``table`` is a bfloat16 (checked a slice at a time)."""
        if table.dtype != torch.float32 or table.dim() != 2:
            return False
        for start in range(0, table.shape[0], rows_at_once):
            rows = table[start : start + rows_at_once]
            if not torch.equal(rows.to(torch.bfloat16).float(), rows):
                return False
        return True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids].float()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format=bf16"


def _dequantize_q8_0(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., K] int8 and scales [..., K / 32] float16 -> [..., K] float32."""
    blocks = codes.float().unflatten(-1, (-1, cpu_kernels.BLOCK)) * scales.float().unsqueeze(-1)
    return blocks.flatten(-2)


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: its embedding's (the KV cache follows it)."""
    kinds = nn.Embedding | Q8Embedding | Bf16Embedding | GgmlEmbedding
    embedding = next(m for m in model.modules() if isinstance(m, kinds))
    return embedding.weight.dtype if isinstance(embedding, nn.Embedding) else embedding.dtype
