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
def _weight_and_residual(W, r_row, offs, mask, HAS_RES: tl.constexpr):
    """The norm's weight (float32) and the residual row (its dtype; 0.0 without one)."""
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_row + offs, mask=mask, other=0.0) if HAS_RES else 0.0
    return w, r


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
    part,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    OFFSET: tl.constexpr,
    PARTS: tl.constexpr,
    PRELOAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row. PARTS > 0: X holds that many float32 partial sums of the row, `part` elements apart, added in
    order and rounded to Out's dtype (kernels.linear.Partials), else X is the row itself. PRELOAD: the residual
    row and the weight are read before the wait for the launch before (which wrote neither: the caller's
    promise), so only x's read is left after it."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    if PRELOAD:
        w, r = _weight_and_residual(W, R + row * stride_r, offs, mask, HAS_RES)
    enter(PDL)
    if not PRELOAD:
        w, r = _weight_and_residual(W, R + row * stride_r, offs, mask, HAS_RES)
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if PARTS > 0:
        for s in tl.static_range(1, PARTS):
            x += tl.load(X + s * part + row * stride_x + offs, mask=mask, other=0.0)
        x = x.to(Out.dtype.element_ty)
    if HAS_RES:
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(R + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / N
    if OFFSET:
        y = xf * tl.rsqrt(var + eps) * (1.0 + w)
    else:
        y = (xf * tl.rsqrt(var + eps)).to(x.dtype).to(tl.float32) * w
    tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=mask)


def add_rms_norm(
    x,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    offset: bool = False,
    preload: bool = False,
) -> torch.Tensor:
    """x, residual: [T, N] (residual updated in place to residual + x). Returns the normalised rows [T, N]. x may
    be a K-split product not added up yet (kernels.linear.Partials): its parts are added here, in split order,
    and rounded to its dtype first, the bits its own launch would have stored. preload: the residual and the
    weight are read before the programmatic-dependent-launch wait; only where the launch just before this one
    wrote neither (a decode graph's norm after the projection whose product x is)."""
    parts = getattr(x, "parts", None)
    if parts is not None:
        nparts, x, dtype = parts.shape[0], parts[0], x.dtype
    else:
        nparts, dtype = 0, x.dtype
    T, N = x.shape
    if out is None:
        out = torch.empty(T, N, dtype=dtype, device=x.device)
    assert out.dtype == dtype, (out.dtype, dtype)
    if T == 0:
        return out
    res = residual if residual is not None else out
    assert res.dtype == dtype, (res.dtype, dtype)
    _add_rms_norm_kernel[(T,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), N, eps, T * N if nparts else 0,
        HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(N), OFFSET=offset, PARTS=nparts, PRELOAD=preload,
        num_warps=8 if N >= 2048 else 4, **launch(x),
    )  # fmt: skip
    return out
