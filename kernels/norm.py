"""Fused residual add + RMSNorm, in Triton.

`add_rms_norm(x, residual, w, eps)` does `residual += x` (rounded to the activation dtype, as the PyTorch model does)
and returns `rms_norm(residual) * w`; with `residual=None` it only normalises. Rounding follows the PyTorch
reference step for step: the sum is rounded, normalised in float32, rounded, then multiplied by the weight.
With `offset=True` the weight is applied as (1 + w) in float32 before a single rounding, as Qwen3-Next's RMSNorm
(`hybrid_model.offset_rms_norm`) does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import enter, launch


@triton.jit
def _add_rms_norm_kernel(
    X,
    R,
    W,
    Out,
    stride_x,
    stride_r,
    stride_o,
    N,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    OFFSET: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(R + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / N
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:
        y = xf * tl.rsqrt(var + eps) * (1.0 + w)
    else:
        y = (xf * tl.rsqrt(var + eps)).to(X.dtype.element_ty).to(tl.float32) * w
    tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    offset: bool = False,
) -> torch.Tensor:
    """x, residual: [T, N] (residual updated in place to residual + x). Returns the normalised rows [T, N]."""
    T, N = x.shape
    if out is None:
        out = torch.empty_like(x)
    if T == 0:
        return out
    res = residual if residual is not None else x
    _add_rms_norm_kernel[(T,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), N, eps,
        HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(N), OFFSET=offset,
        num_warps=8 if N >= 2048 else 4, **launch(x),
    )  # fmt: skip
    return out
