"""W8A8 matmul of fine-grained FP8 weights (backends/common/model/fp8.py's scheme) on FP8 tensor cores.

`w8a8(x, q, scale, group)`: x [M, K] 16- or 32-bit activations, q [N, K] e4m3 weights, scale [N, K / group]
float32 (each row's scale per column block). One program computes a [BM, BN] tile: per column block it loads
x's [BM, group] tile, quantizes each row of it to e4m3 in registers (scale amax / 448, the activations' dynamic
per-token-group quantization: no launch or tensor of its own), multiplies it with the weight's [group, BN] tile
on the FP8 tensor cores and adds the float32 product times both scales. Nothing synchronises with the host, so
the kernel runs inside CUDA graphs.

The rounding to e4m3 is written out (round to nearest even on the value's own step) and then converted, which
is exact: the same bits on the GPU and in Triton's CPU interpreter, whose own float8 conversion misrounds values
that round up into the next power of two."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
EPS = 1e-10
RTNE = 8388608.0  # 2^23: t + 2^23 - 2^23 rounds t in [0, 2^22) to the nearest integer, ties to even


@triton.jit
def round_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even: e4m3 has 3 mantissa bits, so a
    value of exponent e (at least -6, the subnormals' step) lies on a grid of 2^(e - 3)."""
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = ((a / step + RTNE) - RTNE) * step
    r = tl.minimum(r, FP8_MAX)
    return tl.where(v < 0, -r, r)


@triton.jit
def _w8a8_kernel(X, W, WS, Y, M, N, K, KB, stride_xm, stride_wn, stride_wsn, stride_ym,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, KB):
        offs_k = kb * BK + tl.arange(0, BK)
        mask_k = offs_k < K
        x = tl.load(X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)  # fmt: skip
        sx = tl.maximum(tl.max(tl.abs(x), axis=1), EPS) / FP8_MAX
        qx = round_e4m3(tl.minimum(tl.maximum(x / sx[:, None], -FP8_MAX), FP8_MAX)).to(tl.float8e4nv)
        w = tl.load(W + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                    mask=mask_n[None, :] & mask_k[:, None], other=0.0)  # fmt: skip
        ws = tl.load(WS + offs_n.to(tl.int64) * stride_wsn + kb, mask=mask_n, other=0.0)
        acc += tl.dot(qx, w, out_dtype=tl.float32) * sx[:, None] * ws[None, :]
    tl.store(Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


def tiles(M: int, N: int) -> tuple[int, int, int, int]:
    """(BM, BN, warps, stages) by the row count: skinny tiles for decode batches (the weight read dominates and
    the grid must cover the SMs), square ones for prefill."""
    if M <= 16:
        return 16, 32 if N <= 8192 else 64, 4, 4
    if M <= 64:
        return 64, 64, 4, 4
    return 128, 128, 8, 3


def supported(group: int) -> bool:
    """The kernel's column block is the scale group: a multiple of 32 (the FP8 tensor cores' K) up to 256."""
    return group % 32 == 0 and 32 <= group <= 256


def w8a8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int, out: torch.Tensor | None = None):
    """x [M, K] @ (q [N, K] e4m3 with row scales scale [N, ceil(K / group)])^T in the W8A8 scheme: [M, N] in x's
    dtype (a float32 x gives float32)."""
    M, K = x.shape
    N = q.shape[0]
    if not supported(group):
        raise ValueError(f"w8a8: the column block must be a multiple of 32 up to 256, got {group}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    if M == 0:
        return out
    BM, BN, warps, stages = tiles(M, N)
    if x.device.type != "cuda":  # Triton's interpreter runs each program in Python: fewer, larger ones
        BN = 128
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    _w8a8_kernel[grid](x, q, scale, out, M, N, K, scale.shape[1], x.stride(0), q.stride(0), scale.stride(0),
                       out.stride(0), BM=BM, BN=BN, BK=group, num_warps=warps, num_stages=stages)  # fmt: skip
    return out
