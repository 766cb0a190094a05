"""BitNet b1.58 matmul: ternary weights {-1, 0, +1} x int8 per-token activations, int32 accumulation.

``y = (round(x * s_x) @ T.T) / s_x * w_scale`` where ``s_x = 127 / max|x_row|`` (per token, as in
BitNet and transformers' ``BitLinear``), ``T`` is the ternary weight and ``w_scale`` the per-tensor
multiplier (``W ~= T * w_scale``; transformers stores its inverse as ``weight_scale``).

Layout (chosen for the kernel, produced once at load time by :func:`pack_ternary`):

- ``qweight``: int32 ``[K_pad // 16, N]``. Word ``[r, n]`` holds ``T + 1`` (0, 1, 2) for rows
  ``k = 16r .. 16r+15`` of output column ``n``, in bits ``2 * (k % 16)``. Neighbouring output columns
  are neighbouring words, so tile loads are wide and coalesced; 2 bits per weight is 8x fewer bytes
  than fp16. ``K_pad`` is ``K`` rounded up to 16 (padding codes are 1, i.e. zero weights).

Two kernels: :func:`quantize_activations` (one program per row: absmax, then round half to even
like ``torch.round``) and the matmul, which, like the INT4 kernel, has a split-K decode launch for
``M <= 16`` (fp32 ``atomic_add`` of scaled partial sums) and a tiled GEMM launch for larger ``M``.
The dot is int8 x int8 -> int32, exact. Launch configs come from the tuning table
(``engine/kernels/tuning.py``), on a GPU and in the CPU interpreter alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import DECODE_MAX_M, matmul_grid, output_buffer
from engine.kernels.tuning import LaunchConfig, chooser

ACT_QMAX = 127
ACT_EPS = 1e-5  # lower bound on a row's absmax, as in transformers' BitLinear


@triton.jit
def _round_half_even(y):
    r = tl.floor(y + 0.5)
    is_tie = (r - y) == 0.5
    is_odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(is_tie & is_odd, r - 1.0, r)


@triton.jit(do_not_specialize=["K", "stride_xm"])  # one compile for every width
def _quantize_activations_kernel(x_ptr, xq_ptr, x_scale_ptr, K, stride_xm, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    absmax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        absmax = tl.maximum(absmax, tl.abs(x))
    # Correctly rounded division (plain `/` is approximate on a GPU). torch may still differ by an ulp,
    # which moves a rare rounding tie by one int8 step.
    scale = tl.div_rn(tl.full((), 127.0, tl.float32), tl.maximum(tl.max(absmax, axis=0), 1e-5))
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(_round_half_even(x * scale), -128.0), 127.0)
        tl.store(xq_ptr + row * K + k0 + offs, q.to(tl.int8), mask=mask)
    tl.store(x_scale_ptr + row, scale)


@triton.jit(do_not_specialize=["M"])  # one compile for every batch size
def _ternary_matmul_kernel(
    xq_ptr,
    x_scale_ptr,
    qweight_ptr,
    w_scale_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    ATOMIC_OUT: tl.constexpr,
):
    pid_mn = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid_mn // num_pid_n
    pid_n = pid_mn % num_pid_n

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_packed = tl.arange(0, BLOCK_K // 16)
    shifts = (tl.arange(0, 16) * 2)[None, :, None]
    mask_m = offs_m < M
    mask_n = offs_n < N
    num_packed_rows = tl.cdiv(K, 16)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + offs_k
        xq = tl.load(
            xq_ptr + offs_m[:, None] * K + ks[None, :], mask=mask_m[:, None] & (ks[None, :] < K), other=0
        )
        rows = k0 // 16 + offs_packed
        packed = tl.load(
            qweight_ptr + rows[:, None] * N + offs_n[None, :],
            mask=(rows[:, None] < num_packed_rows) & mask_n[None, :],
            other=0x55555555,  # sixteen codes of 1: zero weights
        )
        codes = tl.reshape((packed[:, None, :] >> shifts) & 0x3, (BLOCK_K, BLOCK_N))
        acc = tl.dot(xq, (codes - 1).to(tl.int8), acc, out_dtype=tl.int32)

    x_scale = tl.load(x_scale_ptr + offs_m, mask=mask_m, other=1.0)
    w_scale = tl.load(w_scale_ptr).to(tl.float32)
    out = acc.to(tl.float32) / x_scale[:, None] * w_scale
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    if ATOMIC_OUT:
        tl.atomic_add(out_ptrs, out, mask=out_mask)
    else:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 absmax quantization: ``x [M, K] -> (x_q int8 [M, K], s_x fp32 [M])``."""
    m, k = x.shape
    xq = torch.empty((m, k), device=x.device, dtype=torch.int8)
    x_scale = torch.empty((m,), device=x.device, dtype=torch.float32)
    if m:
        launch_quantize(x, xq, x_scale, chooser().choose("ternary_quantize", 0, k, m))
    return xq, x_scale


def launch_quantize(x: torch.Tensor, xq: torch.Tensor, x_scale: torch.Tensor, config: LaunchConfig) -> None:
    """One launch of the activation quantizer with ``config`` (BLOCK is a loop tile, not the width)."""
    m, k = x.shape
    _quantize_activations_kernel[(m,)](x, xq, x_scale, k, x.stride(0), **config.kwargs())


def ternary_matmul(x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``x[..., K] -> [..., N]`` in ``x.dtype`` for a ternary weight in this module's packed layout."""
    k = x.shape[-1]
    n = qweight.shape[1]
    if qweight.dtype != torch.int32 or qweight.shape[0] != triton.cdiv(k, 16):
        raise ValueError(f"qweight {tuple(qweight.shape)} {qweight.dtype} does not fit K={k}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    xq, x_scale = quantize_activations(x2)
    decode = m <= DECODE_MAX_M
    out = output_buffer(x2, m, n, decode)
    if m:
        config = chooser().choose("ternary_decode" if decode else "ternary_gemm", n, k, m)
        launch_ternary(xq, x_scale, qweight, w_scale, out, config)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def launch_ternary(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    qweight: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor,
    config: LaunchConfig,
) -> None:
    """One matmul launch with ``config`` into ``out`` (zeroed fp32 for a split-K config)."""
    m, k = xq.shape
    n = qweight.shape[1]
    _ternary_matmul_kernel[matmul_grid(m, n, config)](
        xq, x_scale, qweight, w_scale, out, m, n, k, out.stride(0),
        ATOMIC_OUT=config["SPLIT_K"] > 1,
        **config.kwargs(),
    )  # fmt: skip


# -- layout conversion and reference ----------------------------------------------------------------


def pack_ternary(ternary: torch.Tensor) -> torch.Tensor:
    """Ternary weight ``[N, K]`` (values -1, 0, 1) -> kernel layout int32 ``[ceil(K/16), N]``."""
    n, k = ternary.shape
    k_pad = triton.cdiv(k, 16) * 16
    codes = torch.ones((k_pad, n), dtype=torch.int32, device=ternary.device)
    codes[:k] = ternary.t().to(torch.int32) + 1
    if codes.min() < 0 or codes.max() > 2:
        raise ValueError("ternary weights must be -1, 0 or 1")
    grouped = codes.reshape(k_pad // 16, 16, n)
    qweight = torch.zeros((k_pad // 16, n), dtype=torch.int32, device=ternary.device)
    for j in range(16):
        qweight |= grouped[:, j] << (2 * j)
    return qweight


def unpack_ternary(qweight: torch.Tensor, k: int) -> torch.Tensor:
    """Kernel layout -> ternary weight ``[N, K]`` as int8."""
    shifts = torch.arange(0, 32, 2, device=qweight.device, dtype=torch.int32)
    codes = (qweight[:, None, :] >> shifts[None, :, None]) & 0x3
    return (codes.reshape(-1, qweight.shape[1])[:k] - 1).t().to(torch.int8)


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`quantize_activations` (the formula of transformers' ``BitLinear``)."""
    x = x.to(torch.float32)
    scale = ACT_QMAX / x.abs().amax(dim=-1, keepdim=True).clamp(min=ACT_EPS)
    xq = (x * scale).round().clamp(-ACT_QMAX - 1, ACT_QMAX).to(torch.int8)
    return xq, scale.squeeze(-1)


def ternary_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference for :func:`ternary_matmul`."""
    k = x.shape[-1]
    xq, x_scale = quantize_activations_ref(x.reshape(-1, k))
    ternary = unpack_ternary(qweight, k).to(torch.float32)
    out = (xq.to(torch.float32) @ ternary.t()) / x_scale[:, None] * w_scale.to(torch.float32)
    return out.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[1])
