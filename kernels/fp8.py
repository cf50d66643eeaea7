"""W8A8 matmul of fine-grained FP8 weights (backends/common/model/fp8.py's scheme) on FP8 tensor cores.

`w8a8(x, q, scale, group)`: x [M, K] 16- or 32-bit activations, q [N, K] e4m3 weights, scale [N, K / group]
float32 (each row's scale per column block). The activations are quantized per token and column block to e4m3
(scale amax / 448: `activation_scheme: dynamic`), each block's product runs on the FP8 tensor cores and is added
in float32 times both scales (every 128 columns, as DeepSeek-V3's report advises: the tensor cores' own FP8
accumulation keeps about 14 bits).

- Decode batches (at most `FUSE_ROWS` rows): one launch; each program quantizes its [BM, group] tile of x in
  registers (a few rows: cheap beside the weight tile it reads), and K is split in parts when the column tiles
  alone would leave SMs idle (float32 partial sums, added in split order: the result does not depend on which
  part finished first).
- More rows (prefill): `_quant_kernel` quantizes x once ([M, K] e4m3 and [M, K / group] scales), then
  `_w8a8_kernel` multiplies e4m3 tiles on both sides in grouped tile order (tiles that share x rows run together
  and find them in L2).
Nothing synchronises with the host, so both run inside CUDA graphs.

The rounding to e4m3 is written out (round to nearest even on the value's own step) and then converted, which
is exact: the same bits on the GPU and in Triton's CPU interpreter, whose own float8 conversion misrounds values
that round up into the next power of two."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import sm_count

FP8_MAX = tl.constexpr(448.0)
EPS = tl.constexpr(1e-10)
RTNE = tl.constexpr(8388608.0)  # 2^23: t + 2^23 - 2^23 rounds t in [0, 2^22) to the nearest integer, ties to even
FUSE_ROWS = 16  # up to this many rows the GEMM quantizes its own x tiles; above, `_quant_kernel` does it once


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
def _quantize_tile(x):
    """x [BM, BK] float32 -> (e4m3 tile, per-row scale [BM]): amax / 448 per row."""
    sx = tl.maximum(tl.max(tl.abs(x), axis=1), EPS) / FP8_MAX
    q = round_e4m3(tl.minimum(tl.maximum(x / sx[:, None], -FP8_MAX), FP8_MAX)).to(tl.float8e4nv)
    return q, sx


@triton.jit
def _quant_kernel(X, XQ, XS, M, K, KB, stride_xm, BM: tl.constexpr, BK: tl.constexpr):
    """Program (row block, column block): x's tile quantized into XQ [M, K] e4m3 and its scales into XS [M, KB]."""
    pid_m, kb = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = kb * BK + tl.arange(0, BK)
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    x = tl.load(X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    q, sx = _quantize_tile(x.to(tl.float32))
    tl.store(XQ + offs_m[:, None].to(tl.int64) * K + offs_k[None, :], q, mask=mask)
    tl.store(XS + offs_m.to(tl.int64) * KB + kb, sx, mask=offs_m < M)


@triton.jit
def _w8a8_kernel(X, XS, W, WS, Y, M, N, K, KB, KB_PER, stride_xm, stride_wn, stride_wsn, stride_ym, stride_ys,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 FUSED: tl.constexpr, PARTIAL: tl.constexpr):  # fmt: skip
    """Program (tile, K part). FUSED: X holds the activations, quantized here; else X is e4m3 and XS [M, KB] its
    scales. PARTIAL: the part's float32 sums go to Y + part * stride_ys (added by the caller), else Y's dtype."""
    pid, part = tl.program_id(0), tl.program_id(1)
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    kb_lo = part * KB_PER
    kb_hi = tl.minimum(kb_lo + KB_PER, KB)
    for kb in range(kb_lo, kb_hi):
        offs_k = kb * BK + tl.arange(0, BK)
        mask_k = offs_k < K
        xp = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        if FUSED:
            x = tl.load(xp, mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            qx, sx = _quantize_tile(x)
        else:
            qx = tl.load(xp, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            sx = tl.load(XS + offs_m.to(tl.int64) * KB + kb, mask=mask_m, other=0.0)
        w = tl.load(W + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                    mask=mask_n[None, :] & mask_k[:, None], other=0.0)  # fmt: skip
        ws = tl.load(WS + offs_n.to(tl.int64) * stride_wsn + kb, mask=mask_n, other=0.0)
        acc += tl.dot(qx, w, out_dtype=tl.float32) * sx[:, None] * ws[None, :]
    yp = Y + part.to(tl.int64) * stride_ys + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if PARTIAL:
        tl.store(yp, acc, mask=mask)
    else:
        tl.store(yp, acc.to(Y.dtype.element_ty), mask=mask)


def tiles(M: int, N: int) -> tuple[int, int, int, int]:
    """(BM, BN, warps, stages) by the row count: skinny tiles for decode batches (the weight read dominates; K
    parts fill the SMs), square ones for prefill."""
    if M <= FUSE_ROWS:
        return 16, 64, 4, 4
    if M <= 64:
        return 64, 64, 4, 4
    return 128, 128, 8, 3


def parts(tiles_: int, KB: int, sms: int) -> int:
    """K parts for a launch of `tiles_` output tiles over KB column blocks: enough programs for two per SM, at
    least two column blocks per part."""
    if tiles_ >= sms or KB < 4:
        return 1
    return max(1, min(triton.cdiv(2 * sms, tiles_), KB // 2))


def supported(group: int) -> bool:
    """The kernel's column block is the scale group: a multiple of 32 (the FP8 tensor cores' K) up to 256."""
    return group % 32 == 0 and 32 <= group <= 256


def w8a8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int, out: torch.Tensor | None = None,
         splits: int | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ (q [N, K] e4m3 with row scales scale [N, ceil(K / group)])^T in the W8A8 scheme: [M, N] in x's
    dtype (a float32 x gives float32). splits: K parts (None: by the SM count)."""
    M, K = x.shape
    N, KB = q.shape[0], scale.shape[1]
    if not supported(group):
        raise ValueError(f"w8a8: the column block must be a multiple of 32 up to 256, got {group}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    if M == 0:
        return out
    BM, BN, warps, stages = tiles(M, N)
    if x.device.type != "cuda":  # Triton's interpreter runs each program in Python: fewer, larger ones
        BN = 128
    fused = M <= FUSE_ROWS
    if fused:
        xa, xs = x, x
    else:
        xa = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
        xs = torch.empty(M, KB, dtype=torch.float32, device=x.device)
        qbm = 32 if x.device.type == "cuda" else 128
        _quant_kernel[(triton.cdiv(M, qbm), KB)](x, xa, xs, M, K, KB, x.stride(0), BM=qbm, BK=group, num_warps=4)
    n_tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    n_parts = parts(n_tiles, KB, sm_count(x.device)) if splits is None else max(1, min(splits, KB))
    per = triton.cdiv(KB, n_parts)
    n_parts = triton.cdiv(KB, per)
    y = out if n_parts == 1 else torch.empty(n_parts, M, N, dtype=torch.float32, device=x.device)
    _w8a8_kernel[(n_tiles, n_parts)](xa, xs, q, scale, y, M, N, K, KB, per, xa.stride(0), q.stride(0),
                                     scale.stride(0), N if n_parts > 1 else out.stride(0), M * N, BM=BM, BN=BN,
                                     BK=group, GROUP_M=8, FUSED=fused, PARTIAL=n_parts > 1, num_warps=warps,
                                     num_stages=stages)  # fmt: skip
    if n_parts > 1:
        if out.dtype == torch.float32:
            torch.sum(y, 0, out=out)
        else:
            out.copy_(y.sum(0))
    return out
