"""W4A16 matmul: ``y = x @ W.T`` with W stored as 4-bit codes, dequantized inside the kernel.

Layout (chosen for the kernel, produced once at load time by :func:`pack_int4`):

- ``qweight``: int32 ``[K_pad // 8, N]``. Word ``[r, n]`` holds the codes of rows ``k = 8r .. 8r+7``
  of output column ``n``, code ``k % 8`` in bits ``4 * (k % 8)``. Neighbouring output columns are
  neighbouring words, so a tile load is one wide, coalesced read per packed row.
- ``scales`` and ``mins``: fp16 ``[K_pad // G, N]``; the weight is ``w = code * scale + min``.
  This form covers asymmetric AWQ/RTN (``min = -zero * scale``) and GGUF Q4_0/Q4_1 exactly.
- ``K_pad`` is ``K`` rounded up to the group size ``G`` (32, 64 or 128); the padding rows are never
  read against real activations because activation loads are masked at ``K``.

One kernel serves two launch shapes:

- **decode** (``M <= 16``): a 16-row tile, split-K over the grid's second axis, fp32 partial sums
  combined with ``atomic_add``. Batch-1..16 decode is bound by reading the weight once; split-K
  gives enough programs to fill the GPU when ``N`` alone is too small.
- **GEMM** (larger ``M``): classic ``BLOCK_M x BLOCK_N`` tiles, no split, direct store.

The dequantized tile is fed to ``tl.dot`` with fp32 accumulation. The launch config comes from the
tuning table (``engine/kernels/tuning.py``: one of a few fixed configs per group size and launch
kind, else the default), the same way on a GPU and in the CPU interpreter; there the dot runs in
fp32 (the interpreter's bf16 dot is wrong, see docs/quantization.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import INTERPRET
from engine.kernels.launch import DECODE_MAX_M, matmul_grid, output_buffer
from engine.kernels.tuning import INT4_GROUP_SIZES, LaunchConfig, chooser, int4_kernel

SUPPORTED_GROUP_SIZES = INT4_GROUP_SIZES


@triton.jit(do_not_specialize=["M"])  # one compile for every batch size
def _int4_matmul_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    mins_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    ATOMIC_OUT: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_mn = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid_mn // num_pid_n
    pid_n = pid_mn % num_pid_n

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_packed = tl.arange(0, BLOCK_K // 8)
    shifts = (tl.arange(0, 8) * 4)[None, :, None]
    mask_m = offs_m < M
    mask_n = offs_n < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + offs_k
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + ks[None, :],
            mask=mask_m[:, None] & (ks[None, :] < K),
            other=0.0,
        )
        # BLOCK_K is GROUP_SIZE (the tuning spaces), K_pad a multiple of it: packed rows are in bounds.
        packed = tl.load(
            qweight_ptr + (k0 // 8 + offs_packed)[:, None] * N + offs_n[None, :],
            mask=mask_n[None, :],
            other=0,
        )
        codes = tl.reshape((packed[:, None, :] >> shifts) & 0xF, (BLOCK_K, BLOCK_N))
        group = k0 // GROUP_SIZE
        scale = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        minimum = tl.load(mins_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        w = codes.to(tl.float32) * scale[None, :] + minimum[None, :]
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)

    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    if ATOMIC_OUT:
        tl.atomic_add(out_ptrs, acc, mask=out_mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def int4_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``x[..., K] @ W.T -> [..., N]`` in ``x.dtype``, W given in the packed layout of this module."""
    k = x.shape[-1]
    n = qweight.shape[1]
    _check_layout(k, qweight, scales, mins, group_size)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    decode = m <= DECODE_MAX_M
    out = output_buffer(x2, m, n, decode)
    if m == 0:
        return out.to(x.dtype).reshape(*x.shape[:-1], n)
    config = chooser().choose(int4_kernel(group_size, decode), n, k, m)
    launch_int4(x2, qweight, scales, mins, out, group_size, config)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def launch_int4(
    x2: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    out: torch.Tensor,
    group_size: int,
    config: LaunchConfig,
) -> None:
    """One launch of the kernel with ``config`` into ``out`` (zeroed for a split-K config); the tuning
    bench times each config of a space through this."""
    m, k = x2.shape
    n = qweight.shape[1]
    _int4_matmul_kernel[matmul_grid(m, n, config)](
        x2, qweight, scales, mins, out, m, n, k, x2.stride(0), out.stride(0),
        GROUP_SIZE=group_size,
        ATOMIC_OUT=config["SPLIT_K"] > 1,
        DOT_FP32=INTERPRET or x2.dtype == torch.float32,
        **config.kwargs(),
    )  # fmt: skip


def _check_layout(
    k: int, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> None:
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    k_pad = qweight.shape[0] * 8
    if qweight.dtype != torch.int32 or k_pad % group_size or not k <= k_pad < k + group_size:
        raise ValueError(f"qweight {tuple(qweight.shape)} {qweight.dtype} does not fit K={k}, G={group_size}")
    expected = (k_pad // group_size, qweight.shape[1])
    if tuple(scales.shape) != expected or tuple(mins.shape) != expected:
        raise ValueError(f"scales/mins must be {expected}, got {tuple(scales.shape)}, {tuple(mins.shape)}")


# -- layout conversion and reference ----------------------------------------------------------------


def pack_int4(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes ``[N, K]`` (0..15) and per-group ``scales``/``mins`` ``[N, ceil(K/G)]`` -> kernel layout."""
    n, k = codes.shape
    num_groups = triton.cdiv(k, group_size)
    if tuple(scales.shape) != (n, num_groups) or tuple(mins.shape) != (n, num_groups):
        raise ValueError(f"scales/mins must be {(n, num_groups)}")
    k_pad = num_groups * group_size
    padded = torch.zeros((k_pad, n), dtype=torch.int32, device=codes.device)
    padded[:k] = codes.t().to(torch.int32)
    nibbles = padded.reshape(k_pad // 8, 8, n)
    qweight = torch.zeros((k_pad // 8, n), dtype=torch.int32, device=codes.device)
    for j in range(8):
        qweight |= nibbles[:, j] << (4 * j)
    return (
        qweight.contiguous(),
        scales.t().to(torch.float16).contiguous(),
        mins.t().to(torch.float16).contiguous(),
    )


def unpack_int4_codes(qweight: torch.Tensor) -> torch.Tensor:
    """Kernel-layout ``qweight [K_pad/8, N]`` -> codes ``[K_pad, N]`` as uint8."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    codes = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF
    return codes.reshape(-1, qweight.shape[1]).to(torch.uint8)


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int, k: int
) -> torch.Tensor:
    """Kernel layout -> fp32 weight ``[N, K]`` (the ``nn.Linear`` orientation)."""
    codes = unpack_int4_codes(qweight).to(torch.float32)
    scale = scales.to(torch.float32).repeat_interleave(group_size, dim=0)
    minimum = mins.to(torch.float32).repeat_interleave(group_size, dim=0)
    return (codes * scale + minimum)[:k].t()


def int4_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Plain-torch reference for :func:`int4_matmul`: dequantize, fp32 matmul, cast back."""
    w = dequantize_int4(qweight, scales, mins, group_size, x.shape[-1])
    return (x.to(torch.float32) @ w.t()).to(x.dtype)
