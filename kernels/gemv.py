"""Skinny matmul for small batches, y = x @ w.T with x [M, K] (M <= 16) and w [N, K] in bf16: each program owns a
BLOCK_N slice of the output and streams its rows of w once, so a decode step at batch 1-16 is a pure weight read.
Used where it beats cuBLAS (measured by perf/profile_decode.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(
    X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptr = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptr = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    m_mask = (offs_m < M)[:, None]
    n_mask = (offs_n < N)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + offs_k < K)[None, :]
        x = tl.load(x_ptr + k, mask=m_mask & k_mask, other=0.0)
        w = tl.load(w_ptr + k, mask=n_mask & k_mask, other=0.0)
        acc += tl.dot(x, tl.trans(w))
    y_ptr = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=m_mask & (offs_n < N)[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], w [N, K] (both with unit stride on K), M <= 16: returns x @ w.T as [M, N] in x's dtype."""
    M, K = x.shape
    N = w.shape[0]
    assert M <= 16 and w.shape[1] == K and x.stride(1) == 1 and w.stride(1) == 1
    y = out if out is not None else torch.empty(M, N, device=x.device, dtype=x.dtype)
    block_n = 16 if N <= 8192 else 32
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=256, num_warps=4, num_stages=4,
    )  # fmt: skip
    return y
