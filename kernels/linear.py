"""y = x @ w.T for a few rows of x (decode at small batch), in Triton: one program per BLOCK_N output columns reads
its rows of w once, in BLOCK_K pieces, for every row of x; or, for outputs of few columns, K split in parts, each
its own program, whose partial sums the last program of a column block adds in the same launch (no reduce kernel
after it, as cuBLAS adds for some of these shapes) or the launch that reads the product adds (`Partials`). Rows up
to 128 (tensor-core tiles of 16, 32, 64 or 128 rows); more go to cuBLAS."""

from __future__ import annotations

import fcntl
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import norm as norm_module
from kernels.delta_rule import conv_load as _conv_load
from kernels.delta_rule import conv_math as _conv_math
from kernels.delta_rule import conv_rows_finish as _conv_rows_finish
from kernels.delta_rule import conv_rows_load as _conv_rows_load
from kernels.delta_rule import conv_write as _conv_write
from kernels.pdl import enter, launch

MAX_ROWS = 128
TUNE_ROWS = 128  # decode graphs of up to this many rows choose between cuBLAS and skinny_linear (`tune`)

# settings worth trying, from perf/kernels.py linear on an H200 (Llama-3.1-8B projections); the narrow column blocks
# give outputs of 2,048 columns (small models' o/out/down projections) more programs than the H200 has SMs
CANDIDATES = {
    "one row": [
        dict(block_n=16, block_k=512, num_warps=8, num_stages=4, dot=False),
        dict(block_n=16, block_k=512, num_warps=8, num_stages=3, dot=False),
        dict(block_n=16, block_k=256, num_warps=4, num_stages=4, dot=False),
        dict(block_n=8, block_k=512, num_warps=4, num_stages=4, dot=False),
        dict(block_n=4, block_k=512, num_warps=2, num_stages=4, dot=False),
    ],
    "more rows": [
        dict(block_n=64, block_k=256, num_warps=4, num_stages=4, dot=True),
        dict(block_n=64, block_k=256, num_warps=4, num_stages=3, dot=True),
        dict(block_n=32, block_k=256, num_warps=4, num_stages=4, dot=True),
        dict(block_n=32, block_k=512, num_warps=4, num_stages=4, dot=True),
    ],
    "many rows": [  # 17..64 rows: tiles of 32 or 64 rows
        dict(block_n=64, block_k=128, num_warps=4, num_stages=4, dot=True),
        dict(block_n=32, block_k=128, num_warps=4, num_stages=5, dot=True),
        dict(block_n=128, block_k=64, num_warps=4, num_stages=4, dot=True),
        dict(block_n=16, block_k=256, num_warps=4, num_stages=4, dot=True),
        dict(block_n=32, block_k=128, num_warps=4, num_stages=3, dot=True),
    ],
    "most rows": [  # 65..128 rows: tiles of 128 rows
        dict(block_n=64, block_k=64, num_warps=4, num_stages=4, dot=True),
        dict(block_n=128, block_k=64, num_warps=8, num_stages=3, dot=True),
        dict(block_n=64, block_k=128, num_warps=8, num_stages=3, dot=True),
        dict(block_n=32, block_k=128, num_warps=4, num_stages=3, dot=True),
    ],
}
# K split in parts, for outputs of few columns (2,048-column projections of hidden-2,048 models), where one program
# per column block leaves each program a long serial loop over K
SPLIT_CANDIDATES = {
    "one row": [
        dict(block_n=16, block_k=256, num_warps=4, num_stages=4, dot=False, splits=2),
        dict(block_n=16, block_k=256, num_warps=4, num_stages=4, dot=False, splits=4),
        dict(block_n=32, block_k=256, num_warps=4, num_stages=4, dot=False, splits=4),
        dict(block_n=8, block_k=512, num_warps=4, num_stages=4, dot=False, splits=2),
        dict(block_n=16, block_k=512, num_warps=8, num_stages=3, dot=False, splits=2),
        dict(block_n=16, block_k=128, num_warps=4, num_stages=4, dot=False, splits=8),
    ],
    "more rows": [
        dict(block_n=32, block_k=256, num_warps=4, num_stages=4, dot=True, splits=2),
        dict(block_n=64, block_k=256, num_warps=4, num_stages=3, dot=True, splits=2),
        dict(block_n=32, block_k=128, num_warps=4, num_stages=4, dot=True, splits=4),
    ],
    "many rows": [
        dict(block_n=32, block_k=128, num_warps=4, num_stages=5, dot=True, splits=2),
        dict(block_n=64, block_k=128, num_warps=4, num_stages=4, dot=True, splits=2),
        dict(block_n=32, block_k=128, num_warps=4, num_stages=4, dot=True, splits=4),
        dict(block_n=16, block_k=256, num_warps=4, num_stages=4, dot=True, splits=2),
    ],
    "most rows": [
        dict(block_n=64, block_k=64, num_warps=4, num_stages=4, dot=True, splits=2),
        dict(block_n=32, block_k=128, num_warps=4, num_stages=3, dot=True, splits=2),
        dict(block_n=64, block_k=64, num_warps=4, num_stages=4, dot=True, splits=4),
    ],
}

# K split with the product as w @ x.T (`_swap_kernel`), for outputs of few columns: at 32 rows these read
# random:qwen3-next-layout's [2048, 4096] and [2048, 5632] weights at 0.78-0.83 of copy bandwidth against 0.68-0.73
# for SPLIT_CANDIDATES (an H100, perf/results/swap_h100/). Without a K split the swap form was as fast as the
# candidates above alone and slower in the decode step (qwen3.5-9b's in_proj and qkv at 32 rows), so it is not tried
SWAP_CANDIDATES = {
    "many rows": [
        dict(block_n=64, block_k=128, num_warps=4, num_stages=4, dot=True, splits=4, swap=True),
        dict(block_n=64, block_k=128, num_warps=4, num_stages=3, dot=True, splits=8, swap=True),
    ],
}


# above this many rows a skinny_linear pick must beat cuBLAS by this fraction of cuBLAS's time in `tune`: on an H100
# (perf/results/swap_h100/) the layout's in_proj and down at 128 rows picked skinny_linear by 0-0.8% in tune and
# made the decode step 2.6% slower than with cuBLAS for them (12.89 against 12.57 ms)
# the version of the kernels and candidates `tune` times (kernels.linear, kernels.pdl, kernels.norm): the tuning
# cache's picks apply to this version only (`TuneCache`); raise it with any change that can move a pick
TUNE_VERSION = "linear-2"
CUBLAS_MARGIN_ROWS = 64
CUBLAS_MARGIN = 0.03
SPLIT_MAX_N = 4096  # `tune` tries K split for outputs of at most this many columns
# `tune` tries whole-range tiles (one row) for outputs of at most this many columns: on an H200 they were picked for
# an MoE router (257 columns) and for none of random:qwen3-next-layout's projections of 2,048 columns and more
# (perf/results/preload_h200/), where each candidate is only a compile at capture
WHOLE_RANGE_MAX_N = 1024


def whole_range_candidates(K: int) -> list[dict]:
    """One row: settings whose programs each read their whole range of K in one tile loaded before the PDL wait
    (block_k * splits = K, preload), so a projection's weight reads can all be in flight while the launch before
    it finishes; tiles of 8k or 16k weights (4 or 8 warps)."""
    out = []
    for bk in (2048, 1024, 512):
        if K % bk or K // bk > 16:
            continue
        for bn in (8192 // bk, 16384 // bk):
            out.append(dict(block_n=bn, block_k=bk, num_warps=4 if bn * bk <= 8192 else 8, num_stages=1, dot=False,
                            splits=K // bk, preload=True))  # fmt: skip
    return out


def _kind(rows: int) -> str:
    return "one row" if rows == 1 else "more rows" if rows <= 16 else "many rows" if rows <= 64 else "most rows"


@triton.jit
def _before(k, end):
    """k < end as a one-element tensor: a load mask (a bare comparison of integers is none in the interpreter)."""
    return (tl.zeros([1], dtype=tl.int32) + k) < end


@triton.jit
def _prologue_raw(X, R, offs_m, offs_k, k, mask_m, ok, stride_xm, stride_rm, K,
                  GATED: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr):  # fmt: skip
    """What the input columns offs_k + k of rows offs_m are computed from (`_prologue_math`), as loaded: x's tile
    and up's (GATED) or the residual's (NORM with HAS_RES), else x's again. ok (rows): a
    scalar that masks every load off (a prefetch past the end of the loop)."""
    if offs_m is None:
        ptr = X + k + offs_k
        x = tl.load(ptr)
        a = x
        if GATED:
            a = tl.load(ptr + K)
        if NORM:
            if HAS_RES:
                a = tl.load(R + k + offs_k)
    else:
        mask = mask_m[:, None] & ok
        cols = (k + offs_k)[None, :]
        ptr = X + offs_m[:, None] * stride_xm + cols
        x = tl.load(ptr, mask=mask, other=0.0)
        a = x
        if GATED:
            a = tl.load(ptr + K, mask=mask, other=0.0)
        if NORM:
            if HAS_RES:
                a = tl.load(R + offs_m[:, None] * stride_rm + cols, mask=mask, other=0.0)
    return x, a


@triton.jit
def _prologue_math(x, a, NW, offs_k, k, rstd, dtype, ROWS: tl.constexpr, GATED: tl.constexpr,
                   NORM: tl.constexpr, HAS_RES: tl.constexpr):  # fmt: skip
    """The input from `_prologue_raw`'s tiles x, a: silu(gate) * up (GATED) or
    rmsnorm(x + r) * (1 + w) with the row's rstd (NORM; ROWS: each row's), each rounded step by step as its
    unfused launches round it."""
    if GATED:
        g = x.to(tl.float32)
        x = ((g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * a.to(tl.float32)).to(dtype)
    if NORM:  # kernels.norm.add_rms_norm's rounding, offset weights
        w = tl.load(NW + k + offs_k).to(tl.float32)
        if HAS_RES:
            x = (x.to(tl.float32) + a.to(tl.float32)).to(dtype)
        if ROWS:
            x = (x.to(tl.float32) * rstd[:, None] * (1.0 + w)[None, :]).to(dtype)
        else:
            x = (x.to(tl.float32) * rstd * (1.0 + w)).to(dtype)
    return x


@triton.jit
def _prologue(X, R, NW, offs_m, offs_k, k, mask_m, stride_xm, stride_rm, K, rstd, dtype,
              GATED: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr):  # fmt: skip
    """The input columns offs_k + k of rows offs_m ([BLOCK_M, BLOCK_K], or [BLOCK_K] for offs_m None), computed as
    it is read (`_prologue_raw`, then `_prologue_math`)."""
    x, a = _prologue_raw(X, R, offs_m, offs_k, k, mask_m, True, stride_xm, stride_rm, K, GATED, NORM, HAS_RES)
    if offs_m is None:
        x = _prologue_math(x, a, NW, offs_k, k, rstd, dtype, False, GATED, NORM, HAS_RES)
    else:
        x = _prologue_math(x, a, NW, offs_k, k, rstd, dtype, True, GATED, NORM, HAS_RES)
    return x


@triton.jit
def _row_step(acc2, w, X, R, NW, offs_k, k, K, rstd, dtype, GATED: tl.constexpr, NORM: tl.constexpr,
              HAS_RES: tl.constexpr):  # fmt: skip
    """One row: acc2 [BLOCK_N, BLOCK_K] plus the weight tile w times the input columns offs_k + k (`_prologue`)."""
    x = _prologue(X, R, NW, None, offs_k, k, None, 0, 0, K, rstd, dtype, GATED, NORM, HAS_RES)
    return acc2 + w.to(tl.float32) * x.to(tl.float32)[None, :]


@triton.jit
def _skinny_kernel(
    X, W, Y, P, C, R, RO, NW, M, N, K, k_split, stride_xm, stride_wn, stride_ym, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr, SPLITS: tl.constexpr,
    GATED: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_H: tl.constexpr,
    PRELOAD: tl.constexpr, CONV: tl.constexpr, CS, CW, CPages, COutPages, Mixed, s_mix, CC, cs_page,
    KM1: tl.constexpr,
    UNROLL: tl.constexpr, K_FIRST: tl.constexpr, K_SPLIT: tl.constexpr, GLU: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr, NORM_TILE: tl.constexpr, DEFER: tl.constexpr,
):  # fmt: skip
    """Program (column block, K split). With SPLITS > 1 each writes its float32 partial sums to P [SPLITS, M, N],
    and the last of a column block's programs to finish (counted in C, which it resets to 0 for the next launch)
    adds them in split order, so the result does not depend on which finished last. The input as it is read
    (`_prologue`): GATED, x's row is [gate | up] of width 2K and the input silu(gate) * up;
    NORM, rmsnorm(x (+ R with HAS_RES)) * (1 + NW), every program taking each row's sum of squares over all K
    columns (one row: at once, BLOCK_H a power of 2 >= K; DOT: in tiles of BLOCK_K; R and RO have x's row stride)
    and the first writing x + R to RO (the residual stream's next value, never in place: the other programs still
    read R). PRELOAD: the first tile of weights is loaded before waiting for the launch before this one (weights
    are no launch's output). CONV (a linear-attention layer's in_proj): the first CC output columns are also the
    inputs of its causal conv + SiLU (kernels.delta_rule's conv step: row m's state rows of KM1 taps in CS at page
    CPages[m], written at COutPages[m], weights CW), done by the program that finishes a column block, stored
    float32 to Mixed (rows s_mix apart). UNROLL (one row): the loop over K unrolled
    (K_SPLIT = k_split), so every tile's load can be in flight at once. K_FIRST is the first step of either loop
    (BLOCK_K after a preload). GLU (DOT): W is [gate | up] of 2 NC rows and output column c of Y is
    silu(gate c) * up c, each product rounded as stored first (an MLP's gate_up with kernels.act.silu_mul fused
    after it). PREFETCH (DOT with a prologue): the input tiles of the next step of K (and of the sum of squares'
    next step, in tiles of NORM_TILE columns) are loaded before this step's are computed with, so their loads are
    in flight during the product; without it each step waits for its own input's loads, since an input computed
    in registers is not among the loads the compiler pipelines. DEFER (SPLITS > 1, no GLU, no CONV): each program
    only stores its partial sums; the launch that reads the product adds them (`Partials`), so no program waits on
    the counter, fences its stores or reads the others' partials."""
    pid, ps = tl.program_id(0), tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = ps * k_split
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    if GLU:  # output column c: silu(x . w row c) * (x . w row NC + c)
        NC = N // 2
    else:
        NC = N
    mask_n = offs_n < NC
    w_ptr = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    if GLU:
        u_ptr = w_ptr + NC.to(tl.int64) * stride_wn
    if PRELOAD:
        w0 = tl.load(w_ptr, mask=mask_n[:, None], other=0.0)
        if GLU:
            u0 = tl.load(u_ptr, mask=mask_n[:, None], other=0.0)
    enter(PDL)
    rstd = 0.0
    if NORM:
        if DOT:  # each row's sum of squares over all K columns in tiles of BLOCK_K; the first program writes RO
            offs_r = tl.arange(0, BLOCK_M)
            mask_r = offs_r < M
            ssq = tl.zeros([BLOCK_M], dtype=tl.float32)
            first = (pid == 0) & (ps == 0)
            if PREFETCH:  # in tiles of NORM_TILE columns, each loaded a step ahead
                offs_c = tl.arange(0, NORM_TILE)
                v, r = _prologue_raw(X, R, offs_r, offs_c, 0, mask_r, True, stride_xm, stride_xm, K,
                                     False, NORM, HAS_RES)  # fmt: skip
                for k0 in range(0, K, NORM_TILE):
                    vn, rn = _prologue_raw(X, R, offs_r, offs_c, k0 + NORM_TILE, mask_r, _before(k0 + NORM_TILE, K),
                                           stride_xm, stride_xm, K, False, NORM, HAS_RES)  # fmt: skip
                    if HAS_RES:
                        v = (v.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
                        if first:
                            tl.store(RO + offs_r[:, None] * stride_xm + (k0 + offs_c)[None, :], v,
                                     mask=mask_r[:, None])  # fmt: skip
                    vf = v.to(tl.float32)
                    ssq += tl.sum(vf * vf, 1)
                    v, r = vn, rn
            else:
                for k0 in range(0, K, BLOCK_K):
                    at = offs_r[:, None] * stride_xm + (k0 + tl.arange(0, BLOCK_K))[None, :]
                    v = tl.load(X + at, mask=mask_r[:, None], other=0.0)
                    if HAS_RES:
                        r = tl.load(R + at, mask=mask_r[:, None], other=0.0)
                        v = (v.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
                        if first:
                            tl.store(RO + at, v, mask=mask_r[:, None])
                    vf = v.to(tl.float32)
                    ssq += tl.sum(vf * vf, 1)
            rstd = tl.rsqrt(ssq / K + eps)
        else:  # one row: the whole row at once (BLOCK_H)
            offs_h = tl.arange(0, BLOCK_H)
            mask_h = offs_h < K
            v = tl.load(X + offs_h, mask=mask_h, other=0.0)
            if HAS_RES:
                r = tl.load(R + offs_h, mask=mask_h, other=0.0)
                v = (v.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
                if (pid == 0) & (ps == 0):
                    tl.store(RO + offs_h, v, mask=mask_h)
            vf = v.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(vf * vf, 0) / K + eps)
    if DOT:  # tensor cores over x padded to BLOCK_M rows
        offs_m = tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if GLU:
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # the up half's
        if PRELOAD:
            x = _prologue(X, R, NW, offs_m, offs_k, 0, mask_m, stride_xm, stride_xm, K, rstd,
                          W.dtype.element_ty, GATED, NORM, HAS_RES)  # fmt: skip
            acc += tl.dot(x, tl.trans(w0))
            if GLU:
                acc_u += tl.dot(x, tl.trans(u0))
        if PREFETCH:
            xr, ar = _prologue_raw(X, R, offs_m, offs_k, K_FIRST, mask_m, _before(K_FIRST, k_split), stride_xm,
                                   stride_xm, K, GATED, NORM, HAS_RES)  # fmt: skip
            for k0 in range(K_FIRST, k_split, BLOCK_K):
                w = tl.load(w_ptr + k0, mask=mask_n[:, None], other=0.0)
                if GLU:
                    u = tl.load(u_ptr + k0, mask=mask_n[:, None], other=0.0)
                xn, an = _prologue_raw(X, R, offs_m, offs_k, k0 + BLOCK_K, mask_m, _before(k0 + BLOCK_K, k_split),
                                       stride_xm, stride_xm, K, GATED, NORM, HAS_RES)  # fmt: skip
                x = _prologue_math(xr, ar, NW, offs_k, k0, rstd, W.dtype.element_ty, True, GATED, NORM,
                                   HAS_RES)  # fmt: skip
                acc += tl.dot(x, tl.trans(w))
                if GLU:
                    acc_u += tl.dot(x, tl.trans(u))
                xr, ar = xn, an
        else:
            for k0 in range(K_FIRST, k_split, BLOCK_K):
                x = _prologue(X, R, NW, offs_m, offs_k, k0, mask_m, stride_xm, stride_xm, K, rstd,
                              W.dtype.element_ty, GATED, NORM, HAS_RES)  # fmt: skip
                w = tl.load(w_ptr + k0, mask=mask_n[:, None], other=0.0)
                acc += tl.dot(x, tl.trans(w))
                if GLU:
                    u = tl.load(u_ptr + k0, mask=mask_n[:, None], other=0.0)
                    acc_u += tl.dot(x, tl.trans(u))
        offs_y = offs_m[:, None] * stride_ym + offs_n[None, :]
        offs_p = offs_m[:, None] * N + offs_n[None, :]
        mask_y = mask_m[:, None] & mask_n[None, :]
    else:  # one row: products summed along K at the end
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if PRELOAD:
            acc2 = _row_step(acc2, w0, X, R, NW, offs_k, 0, K, rstd, W.dtype.element_ty, GATED, NORM,
                             HAS_RES)  # fmt: skip
        if UNROLL:
            for k0 in tl.static_range(K_FIRST, K_SPLIT, BLOCK_K):
                w = tl.load(w_ptr + k0, mask=mask_n[:, None], other=0.0)
                acc2 = _row_step(acc2, w, X, R, NW, offs_k, k0, K, rstd, W.dtype.element_ty, GATED,
                                 NORM, HAS_RES)  # fmt: skip
        else:
            for k0 in range(K_FIRST, k_split, BLOCK_K):
                w = tl.load(w_ptr + k0, mask=mask_n[:, None], other=0.0)
                acc2 = _row_step(acc2, w, X, R, NW, offs_k, k0, K, rstd, W.dtype.element_ty, GATED,
                                 NORM, HAS_RES)  # fmt: skip
        acc = tl.sum(acc2, 1)
        offs_y = offs_n
        offs_p = offs_n
        mask_y = mask_n
        offs_m = None
        mask_m = None
    if SPLITS == 1:
        if GLU:
            tl.store(Y + offs_y, _silu_mul(acc, acc_u, Y.dtype.element_ty), mask=mask_y)
        else:
            tl.store(Y + offs_y, acc.to(Y.dtype.element_ty), mask=mask_y)
        if CONV:
            _conv_epilogue(acc.to(Y.dtype.element_ty), offs_m, mask_m, offs_n, mask_n, CS, CW, CPages, COutPages,
                           Mixed, s_mix, CC, cs_page, KM1, DOT)  # fmt: skip
    else:
        part = M * N  # P is [SPLITS, M, N] with rows of N (GLU: the up half's partials at NC + c)
        tl.store(P + ps * part + offs_p, acc, mask=mask_y)
        if GLU:
            tl.store(P + ps * part + offs_p + NC, acc_u, mask=mask_y)
        if not DEFER:  # else the launch that reads the product adds them (`Partials`)
            done = tl.atomic_add(C + pid, 1, sem="acq_rel")  # releases this program's partials, acquires the others'
            if done == SPLITS - 1:
                total = _sum_parts(P, offs_p, mask_y, part, SPLITS)
                if GLU:
                    total_u = _sum_parts(P + NC, offs_p, mask_y, part, SPLITS)
                    tl.store(Y + offs_y, _silu_mul(total, total_u, Y.dtype.element_ty), mask=mask_y)
                else:
                    tl.store(Y + offs_y, total.to(Y.dtype.element_ty), mask=mask_y)
                if CONV:
                    _conv_epilogue(total.to(Y.dtype.element_ty), offs_m, mask_m, offs_n, mask_n, CS, CW, CPages,
                                   COutPages, Mixed, s_mix, CC, cs_page, KM1, DOT)  # fmt: skip
                tl.atomic_xchg(C + pid, 0)


@triton.jit
def _swap_kernel(
    X, W, Y, P, C, M, N, k_split, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, GLU: tl.constexpr,
    PRELOAD: tl.constexpr, K_FIRST: tl.constexpr, DEFER: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """skinny_linear's `swap` form: the product taken as y.T = w @ x.T, each program's BLOCK_N rows of w the left
    operand of the tensor cores' product (the side whose tile has 64 or more rows on Hopper's warpgroup MMA) and
    x.T's BLOCK_M columns the right one, so a few rows of x fill the narrow side of the tile. Program (column
    block, K split); SPLITS, GLU, PRELOAD and DEFER as in `_skinny_kernel` (GLU without a K split)."""
    pid, ps = tl.program_id(0), tl.program_id(1)
    if GLU:
        NC = N // 2
    else:
        NC = N
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < NC
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_k = ps * k_split + tl.arange(0, BLOCK_K)
    w_ptr = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptr = X + offs_m[None, :] * stride_xm + offs_k[:, None]  # x.T's tile [BLOCK_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if GLU:
        u_ptr = w_ptr + NC.to(tl.int64) * stride_wn
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if PRELOAD:
        w0 = tl.load(w_ptr, mask=mask_n[:, None], other=0.0)
        if GLU:
            u0 = tl.load(u_ptr, mask=mask_n[:, None], other=0.0)
    enter(PDL)
    if PRELOAD:
        xt = tl.load(x_ptr, mask=mask_m[None, :], other=0.0)
        acc += tl.dot(w0, xt)
        if GLU:
            acc_u += tl.dot(u0, xt)
    for k0 in range(K_FIRST, k_split, BLOCK_K):
        w = tl.load(w_ptr + k0, mask=mask_n[:, None], other=0.0)
        xt = tl.load(x_ptr + k0, mask=mask_m[None, :], other=0.0)
        acc += tl.dot(w, xt)
        if GLU:
            u = tl.load(u_ptr + k0, mask=mask_n[:, None], other=0.0)
            acc_u += tl.dot(u, xt)
    offs_y = offs_m[None, :] * stride_ym + offs_n[:, None]
    mask_y = mask_m[None, :] & mask_n[:, None]
    if SPLITS == 1:
        if GLU:
            tl.store(Y + offs_y, _silu_mul(acc, acc_u, Y.dtype.element_ty), mask=mask_y)
        else:
            tl.store(Y + offs_y, acc.to(Y.dtype.element_ty), mask=mask_y)
    else:
        part = M * N  # P is [SPLITS, M, N], as `_skinny_kernel` leaves it
        offs_p = offs_m[None, :] * N + offs_n[:, None]
        tl.store(P + ps * part + offs_p, acc, mask=mask_y)
        if not DEFER:
            done = tl.atomic_add(C + pid, 1, sem="acq_rel")  # releases this program's partials, acquires the others'
            if done == SPLITS - 1:
                total = _sum_parts(P, offs_p, mask_y, part, SPLITS)
                tl.store(Y + offs_y, total.to(Y.dtype.element_ty), mask=mask_y)
                tl.atomic_xchg(C + pid, 0)


@triton.jit
def _sum_parts(P, offs_p, mask, part, SPLITS: tl.constexpr):
    """The K split's float32 partial sums at offs_p (parts `part` elements apart) added in split order, read from
    L2 (.cg: this SM may hold stale lines of them from an earlier launch)."""
    total = tl.load(P + offs_p, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLITS):
        total += tl.load(P + s * part + offs_p, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _silu_mul(g, u, dtype):
    """silu(g) * u of float32 products g, u rounded to dtype as stored, with kernels.act.silu_mul's roundings."""
    g = g.to(dtype).to(tl.float32)
    u = u.to(dtype).to(tl.float32)
    return ((g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * u).to(dtype)


@triton.jit
def _conv_epilogue(y, offs_m, mask_m, offs_n, mask_n, CS, CW, CPages, COutPages, Mixed, s_mix, CC, cs_page,
                   KM1: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """kernels.delta_rule's conv step over the output columns offs_n below CC (y: their values as stored), into
    Mixed (rows s_mix apart): one row (y [BLOCK_N], its pages CPages[0] / COutPages[0]), or with ROWS each row m of
    y [BLOCK_M, BLOCK_N] (offs_m where mask_m) on its own pages CPages[m] / COutPages[m]. Every load comes before
    any store."""
    y = y.to(tl.float32)  # before the reads, as the conv step orders them
    prev, w, out_page = _conv_inputs(offs_m, mask_m, offs_n, mask_n, CW, CS, CPages, COutPages, CC, cs_page, KM1,
                                     ROWS)  # fmt: skip
    _conv_finish(y, offs_m, mask_m, offs_n, mask_n, prev, w, out_page, CS, Mixed, s_mix, CC, cs_page, KM1, ROWS)


@triton.jit
def _conv_inputs(offs_m, mask_m, offs_n, mask_n, CW, CS, CPages, COutPages, CC, cs_page, KM1: tl.constexpr,
                 ROWS: tl.constexpr):  # fmt: skip
    """What `_conv_epilogue` reads besides the product, for `_conv_finish`: (state rows, weights, out pages) of the
    output columns offs_n below CC, kernels.delta_rule's conv_rows_load with ROWS, else its conv_load at one
    row's pages CPages[0] / COutPages[0] (offs_m and mask_m unused)."""
    mask = mask_n & (offs_n < CC)
    if ROWS:
        prev, w, out_page = _conv_rows_load(offs_m, mask_m, offs_n, mask, CW, CS, CPages, COutPages, cs_page, KM1)
    else:
        prev, w = _conv_load(offs_n, mask, CW, CS, tl.load(CPages).to(tl.int64), cs_page, KM1)
        out_page = tl.load(COutPages).to(tl.int64)
    return prev, w, out_page


@triton.jit
def _conv_finish(y, offs_m, mask_m, offs_n, mask_n, prev, w, out_page, CS, Mixed, s_mix, CC, cs_page,
                 KM1: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """The rest of `_conv_epilogue` on `_conv_inputs`' reads: the conv of y into Mixed and the new state rows."""
    mask = mask_n & (offs_n < CC)
    if ROWS:
        out = _conv_rows_finish(y.to(tl.float32), prev, w, out_page, offs_m, mask_m, offs_n, mask, CS, cs_page, KM1)
        tl.store(Mixed + offs_m[:, None] * s_mix + offs_n[None, :], out, mask=mask_m[:, None] & mask[None, :])
    else:
        out, full = _conv_math(y.to(tl.float32), prev, w, KM1)
        _conv_write(full, offs_n, mask, CS, out_page, cs_page, KM1)
        tl.store(Mixed + offs_n, out, mask=mask)


# per (device, stream): the zeroed arrival counters of split launches (each launch leaves them at 0 again); made
# outside graph capture (the first launch on a stream is a warm-up or a tuning run) and kept for the process's life,
# since captured graphs hold their address
_COUNTERS: dict[tuple, torch.Tensor] = {}
MAX_COLUMN_BLOCKS = 1 << 14


def _counters(device: torch.device) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    c = _COUNTERS.get(key)
    if c is None:
        assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), "split launch first in a capture"
        c = _COUNTERS[key] = torch.zeros(MAX_COLUMN_BLOCKS, dtype=torch.int32, device=device)
    return c


def skinny_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor | None = None,
    block_n: int = 32,
    block_k: int = 256,
    num_warps: int = 4,
    num_stages: int = 4,
    dot: bool | None = None,
    splits: int = 1,
    gated: bool = False,
    norm: tuple | None = None,
    preload: bool = False,
    conv: tuple | None = None,
    unroll: bool = False,
    glu: bool = False,
    prefetch: bool = False,
    norm_tile: int = 0,
    defer: bool = False,
    swap: bool = False,
) -> torch.Tensor | Partials:
    """x: [M, K] with M <= MAX_ROWS, w: [N, K], both with unit stride along K, K a multiple of block_k * splits.
    Returns [M, N]. dot: tensor cores (default for M > 1) or plain products (default for M == 1). splits: K cut in
    that many parts, each its own program (more programs in flight for outputs of few columns), added in a fixed
    order. What multiplies w is computed as it is read (one launch instead of two or three):
    - gated: x is [M, 2K] = [gate | up] and the input is silu(gate) * up (kernels.act.silu_mul fused);
    - norm = (residual or None, weight, eps, residual_out): the input is rmsnorm(x + residual) * (1 + weight) as
      kernels.norm.add_rms_norm(..., offset=True) gives it, row by row, and x + residual is written to residual_out
      (a tensor of its own: the residual is not updated in place); x, residual and residual_out contiguous.
    preload: the first weight tile is loaded before waiting for the launch before (programmatic dependent
    launch). conv = (weight [C, KM1 + 1], state [pages, C, KM1] float32 (unit stride in a page), pages [M],
    out_pages [M], mixed [M, C] float32 with unit stride along C): the first C outputs of row m also go through
    kernels.delta_rule.conv_step (its state read at pages[m], written at out_pages[m]) into mixed[m]. unroll
    (one row): the loop over K unrolled (a compile per K). glu (tensor cores): w is [gate | up] ([2C, K]) and the
    result [M, C] is silu(x @ gate.T) * (x @ up.T), kernels.act.silu_mul fused after the product. prefetch
    (tensor cores with gated or norm): each step's input tiles loaded a step ahead, the norm's sum
    of squares read in tiles of norm_tile columns (a power of 2 dividing K; 0: block_k). defer (splits > 1, no
    glu, no conv): returns the K split's partial sums unadded (`Partials`, for kernels.norm.add_rms_norm to add);
    out is not written. swap (tensor cores; with splits,
    glu, preload and defer only, glu without splits): the product as w @ x.T (`_swap_kernel`, whose block_n is the
    tile side that wants 64 rows or more), the same result up to the order of the float32 sums."""
    M, K = x.shape
    if gated:
        K //= 2
    N = w.shape[0]
    assert M <= MAX_ROWS and K % (block_k * splits) == 0 and x.stride(1) == 1 and w.stride(1) == 1, (x.shape, w.shape)
    assert w.shape[1] == K, (x.shape, w.shape, gated)
    dot = M > 1 if dot is None else dot
    if glu:
        assert dot and N % 2 == 0 and conv is None, "glu: tensor cores, [gate | up] weights, no conv"
    cols = N // 2 if glu else N
    if out is None:  # with defer nothing is written to it
        out = x if defer else torch.empty(M, cols, device=x.device, dtype=x.dtype)
    if not dot:
        assert M == 1
    grid = (triton.cdiv(cols, block_n), splits)
    if defer:
        assert splits > 1 and not glu and conv is None, "defer: a K split, no glu, no conv"
    if splits > 1:
        assert grid[0] <= MAX_COLUMN_BLOCKS and out.stride(1) == 1
        part, counters = torch.empty(splits, M, N, device=x.device, dtype=torch.float32), _counters(x.device)
    else:
        part = counters = out
    res = res_out = nw = x
    eps = 0.0
    if norm is not None:
        residual, nw, eps, res_out = norm
        assert not gated, "norm: no other prologue"
        assert nw.shape == (K,) and x.is_contiguous()
        if residual is not None:
            assert residual.shape == x.shape and residual.is_contiguous() and res_out.shape == x.shape
            assert res_out.is_contiguous()
            assert res_out.data_ptr() not in (x.data_ptr(), residual.data_ptr()), "norm: residual_out is its own"
            res = residual
    if unroll:
        assert not dot, "unroll: one row"
    if prefetch:
        assert dot and (gated or norm is not None), "prefetch: tensor cores, a prologue"
    norm_tile = norm_tile or block_k
    assert K % norm_tile == 0 and norm_tile & (norm_tile - 1) == 0, ("norm_tile", norm_tile, K)
    cw, cs, cpages, cout_pages, mixed = (x, x, x, x, x) if conv is None else conv
    if conv is not None:
        assert cs.stride(2) == 1 and cs.stride(1) == cw.shape[1] - 1 and mixed.stride(1) == 1
        assert cpages.numel() >= M and cout_pages.numel() >= M and mixed.shape[0] >= M
        assert cw.shape[0] <= N and cw.is_contiguous()
    if swap:
        assert dot and not (gated or norm is not None or conv is not None or unroll or prefetch), (
            "swap: tensor cores, no prologue, no conv"
        )
        assert not (glu and splits > 1), "swap: glu without a K split"
        _swap_kernel[grid](
            x, w, out, part, counters, M, N, K // splits, x.stride(0), w.stride(0), out.stride(0),
            BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=splits, GLU=glu,
            PRELOAD=preload, K_FIRST=block_k if preload else 0, DEFER=defer, num_warps=num_warps,
            num_stages=num_stages, **launch(x),
        )  # fmt: skip
        return Partials(part, x.dtype) if defer else out
    _skinny_kernel[grid](
        x, w, out, part, counters, res, res_out, nw, M, N, K, K // splits, x.stride(0), w.stride(0),
        out.stride(0), eps,
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot, SPLITS=splits,
        GATED=gated, NORM=norm is not None,
        HAS_RES=norm is not None and norm[0] is not None, BLOCK_H=triton.next_power_of_2(K), PRELOAD=preload,
        CONV=conv is not None, CS=cs, CW=cw, CPages=cpages, COutPages=cout_pages, Mixed=mixed,
        s_mix=0 if conv is None else mixed.stride(0),
        CC=0 if conv is None else cw.shape[0], cs_page=0 if conv is None else cs.stride(0),
        KM1=3 if conv is None else cw.shape[1] - 1, UNROLL=unroll,
        K_FIRST=block_k if preload else 0,
        K_SPLIT=K // splits if unroll else 0, GLU=glu, PREFETCH=prefetch, NORM_TILE=norm_tile, DEFER=defer,
        num_warps=num_warps, num_stages=num_stages, **launch(x),
    )  # fmt: skip
    return Partials(part, x.dtype) if defer else out


class Partials:
    """A product not added up yet: a K-split skinny_linear's partial sums [splits, M, N] float32 (`parts`), which
    the launch reading the product adds in split order and rounds to `dtype`, as the split's last program would
    have before storing it (kernels.norm.add_rms_norm takes them for x), so the product's bits are the same."""

    __slots__ = ("parts", "dtype")

    def __init__(self, parts: torch.Tensor, dtype: torch.dtype):
        self.parts, self.dtype = parts, dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.parts.shape[1:]

    def sum(self) -> torch.Tensor:
        """The product as skinny_linear stores it (for checks; decode graphs let add_rms_norm add the parts)."""
        total = self.parts[0].clone()
        for p in self.parts[1:]:
            total += p
        return total.to(self.dtype)


FUSED = ("norm", "conv")  # settings' flags for fused work whose inputs the caller passes


def _skinny(x: torch.Tensor, w: torch.Tensor, settings: dict, conv: tuple | None = None, **fused) -> torch.Tensor:
    """skinny_linear with `settings` less their FUSED flags and the fused inputs given; conv in the launch where the
    settings say conv, else `_conv_after` it."""
    plain = {k: v for k, v in settings.items() if k not in FUSED}
    if conv is not None and settings.get("conv"):
        return skinny_linear(x, w, **plain, conv=conv, **fused)
    return _conv_after(skinny_linear(x, w, **plain, **fused), conv)


def _conv_after(y: torch.Tensor, conv: tuple | None) -> torch.Tensor:
    """y, after kernels.delta_rule.conv_step of its first columns into conv's mixed (in a launch of its own, which
    reads its state rows before the wait for y's launch: a projection writes no conv state)."""
    if conv is not None:
        from kernels.delta_rule import conv_step

        weight, state, pages, out_pages, mixed = conv
        conv_step(y, weight, state, pages, out=mixed, out_pages=out_pages, preload=True)
    return y


def linear(x: torch.Tensor, w: torch.Tensor, settings: dict | None, conv: tuple | None = None) -> torch.Tensor:
    """skinny_linear with `settings` (its keyword arguments) when given, else cuBLAS (F.linear). A setting chosen
    with fused work whose inputs are not given here runs without it. conv: skinny_linear's conv (a linear-attention
    layer's in_proj), fused where the settings say conv, else conv_step after the product."""
    if settings is None:
        return _conv_after(F.linear(x, w), conv)
    return _skinny(x, w, settings, conv)


def glu_after(y: torch.Tensor, settings: dict | None) -> torch.Tensor:
    """What a [gate | up] projection's caller takes next: y itself where `settings` say glu (the launch gave
    silu(gate) * up), else kernels.act.silu_mul(y)."""
    if settings is not None and settings.get("glu"):
        return y
    from kernels.act import silu_mul

    return silu_mul(y)


def gated_linear(gate_up: torch.Tensor, w: torch.Tensor, settings: dict | None) -> torch.Tensor:
    """silu(gate) * up of gate_up = [gate | up], times w.T: one skinny_linear launch where `settings` say gated,
    else kernels.act.silu_mul and then `linear`."""
    if settings is not None and settings.get("gated"):
        return _skinny(gate_up, w, settings)
    from kernels.act import silu_mul

    return linear(silu_mul(gate_up), w, settings)


def normed_linear(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, w: torch.Tensor,
                  settings: dict | None, conv: tuple | None = None,
                  preload: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(rmsnorm(x + residual) * (1 + weight) @ w.T, the residual stream x + residual (x itself without a residual)).
    One skinny_linear launch, the residual stream written to a new tensor, where `settings` say norm (one row);
    else kernels.norm.add_rms_norm (the residual updated in place; preload as there) and `linear`. conv: as for
    `linear`."""
    if settings is not None and settings.get("norm"):
        assert not isinstance(x, Partials), "norm in the launch: the product before it added up (no defer)"
        res_out = torch.empty_like(x) if residual is not None else x
        return _skinny(x, w, settings, conv, norm=(residual, weight, eps, res_out)), res_out
    from kernels.norm import add_rms_norm

    y = linear(add_rms_norm(x, residual, weight, eps, offset=True, preload=preload), w, settings, conv)
    return y, (x if residual is None else residual)


# `tune`'s prologues -> the flag of a skinny_linear setting that computes that input as it reads it
PROLOGUE_FLAGS = {"silu": "gated", "norm": "norm"}


def prologue_linear(prologue: str | None, x: torch.Tensor, w: torch.Tensor, settings: dict | None,
                    norm: tuple | None = None, conv: tuple | None = None) -> torch.Tensor:  # fmt: skip
    """w times the input that `prologue` (one of PROLOGUE_FLAGS, or None: x itself) computes from x, fused or not
    as `settings` say: "silu" (`gated_linear`), "norm" with norm =
    (residual, weight, eps) (`normed_linear`'s product; an unfused norm updates the residual in place). conv: as
    for `linear` (with no prologue or the norm)."""
    if prologue == "silu":
        return gated_linear(x, w, settings)
    if prologue == "norm":
        residual, weight, eps = norm
        return normed_linear(x, residual, weight, eps, w, settings, conv)[0]
    return linear(x, w, settings, conv)


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """fn() captured as a CUDA graph, after one run on the capture's own stream (which compiles, and makes the
    arrival counters that counted launches on that stream find at capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    return g


def graph_time(fn, reps: int = 20) -> float:
    """Seconds per replay of a CUDA graph holding fn() (`capture_graph`)."""
    g = capture_graph(fn)
    for _ in range(3):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps / 1e3


class TuneCache:
    """`tune`'s picks kept in a JSON file, keyed by everything a pick depends on (`_tune_key`: the GPU's name,
    torch's and triton's versions, the weights' dtype, shape and count, the rows, the prologue, the conv channels
    and the epilogue), for one version of the kernels and candidates it times: the file names TUNE_VERSION, and a
    file of another version counts as empty and is replaced at the first write, so stale picks do not pile up.
    Raise TUNE_VERSION with any change that can move a pick or its time (a kernel's code, a candidate, a tuning
    stage), not with an edit of comments or docstrings.
    The file is `TRITON_PD_TUNE_CACHE` ("off": no cache), by default linear-tune.json in triton-pd's cache folder
    (`TRITON_PD_CACHE`, else ~/.cache/triton-pd). Processes that share it merge their entries under a lock and
    replace the file whole, so a reader never sees half of one. A file that cannot be read or written leaves
    tuning as it is without a cache (one warning)."""

    def __init__(self, path: Path | None, code: str | None = None):
        self.path = path
        self.code = TUNE_VERSION if code is None else code
        self.entries: dict[str, dict] | None = None
        self.warned = False
        self.hits = self.misses = 0

    @staticmethod
    def default_path() -> Path | None:
        where = os.environ.get("TRITON_PD_TUNE_CACHE")
        if where == "off":
            return None
        if where:
            return Path(where)
        return Path(os.environ.get("TRITON_PD_CACHE", Path.home() / ".cache" / "triton-pd")) / "linear-tune.json"

    def _read(self) -> dict[str, dict]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            self._warn(f"not read ({e!r}): tuning afresh")
            return {}
        if not isinstance(data, dict) or data.get("code") != self.code:
            return {}  # another version of the kernels: its picks do not apply
        entries = data.get("entries")
        return entries if isinstance(entries, dict) else {}

    def _warn(self, message: str) -> None:
        if not self.warned:
            self.warned = True
            print(f"[triton-pd] tuning cache {self.path}: {message}", file=sys.stderr, flush=True)

    def get(self, key: str) -> dict | None:
        if self.path is None:
            return None
        if self.entries is None:
            self.entries = self._read()
        hit = self.entries.get(key)
        ok = isinstance(hit, dict) and isinstance(hit.get("times"), dict) and isinstance(hit.get("choice"), dict | None)
        self.hits += ok
        self.misses += not ok
        return hit if ok else None

    def put(self, key: str, choice: dict | None, times: dict) -> None:
        if self.path is None:
            return
        entry = {"choice": choice, "times": times}
        self.entries = dict(self.entries or {}, **{key: entry})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                merged = dict(self._read(), **{key: entry})
                tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"code": self.code, "entries": merged}, indent=1, sort_keys=True))
                os.replace(tmp, self.path)
            self.entries = dict(merged, **self.entries)
        except OSError as e:
            self._warn(f"not written ({e!r}): this process keeps its picks in memory")


_TUNE_CACHE: TuneCache | None = None


def tune_cache() -> TuneCache:
    """The process's tuning cache, at `TuneCache.default_path()` as it reads when first used."""
    global _TUNE_CACHE
    if _TUNE_CACHE is None:
        _TUNE_CACHE = TuneCache(TuneCache.default_path())
    return _TUNE_CACHE


def _tune_key(weights: list[torch.Tensor], rows: int, prologue, conv_channels: int, epilogue) -> str:
    """What a `tune` pick depends on besides the kernels' code, as the tuning cache's key."""
    w = weights[0]
    gpu = torch.cuda.get_device_name(w.device) if w.device.type == "cuda" else w.device.type
    fields = [gpu, torch.__version__, triton.__version__, str(w.dtype), list(w.shape), len(weights), rows, prologue,
              conv_channels, epilogue]  # fmt: skip
    return json.dumps(fields)


@dataclass(frozen=True)
class TuneContext:
    """What `tune`'s stages know of the projection being tuned."""

    rows: int
    K: int
    prologue: str | None
    pflag: str | None  # the prologue's settings flag (PROLOGUE_FLAGS), None without one
    norm_after: bool  # an add + RMSNorm launch reads the product next (epilogue "norm")
    candidates: list[dict]  # the settings of the first stage: the tile candidates, with and without the fusions


@dataclass(frozen=True)
class TuneStage:
    """One stage of `tune`'s search: where it applies (`when`), and the settings it times next (`propose`) from the
    settings timed so far, their times and the pick so far; each proposal is a compile at capture time, so a stage
    crosses its variant with a few of the fastest settings, not with every candidate."""

    name: str
    when: Callable[[TuneContext], bool]
    propose: Callable[[TuneContext, list, dict, dict | None], list[dict]]


def _stage_prefetch(c: TuneContext, settings: list, times: dict, best) -> list[dict]:
    """The two fastest with the prologue fused, with their input tiles loaded a step ahead; the norm's fastest also
    with its sum of squares in fewer, wider steps (tiles of 256 columns)."""
    ahead = [dict(s, prefetch=True) for s in by_time(settings, times, lambda s: s.get(c.pflag))[:2]]
    if c.prologue == "norm" and ahead and ahead[0]["block_k"] < 256 and c.K % 256 == 0:
        ahead.append(dict(ahead[0], norm_tile=256))
    return ahead


def _stage_unroll(c: TuneContext, settings: list, times: dict, best) -> list[dict]:
    """One row: the three fastest with a loop over K, with the loop unrolled."""
    if best is None:
        return []
    return [dict(s, unroll=True) for s in by_time(settings, times, lambda s: not s.get("preload"))[:3]]


def _stage_preload(c: TuneContext, settings: list, times: dict, best) -> list[dict]:
    """The first weight tile loaded before the PDL wait: at one row the pick's, at more rows the fastest
    candidate's even where cuBLAS was the faster so far (cuBLAS's launches cannot start early; a preloading one
    overlaps the launch before)."""
    if c.rows == 1:
        return [dict(best, preload=True)] if best is not None and not best.get("preload") else []
    timed = by_time(settings, times)
    return [dict(timed[0], preload=True)] if timed else []


# `tune`'s stages, in order (the first proposes the candidates themselves, `tune` computes them)
TUNE_STAGES = (
    TuneStage("candidates", lambda c: True, lambda c, settings, times, best: c.candidates),
    TuneStage("prefetch", lambda c: c.pflag is not None and c.rows > 1, _stage_prefetch),
    TuneStage(
        "defer",  # the two fastest with K split, their partial sums left for the norm's launch to add
        lambda c: c.norm_after,
        lambda c, settings, times, best: [
            dict(s, defer=True) for s in by_time(settings, times, lambda s: s.get("splits", 1) > 1)[:2]
        ],
    ),
    TuneStage("unroll", lambda c: c.rows == 1, _stage_unroll),
    TuneStage("preload", lambda c: True, _stage_preload),
)


def tune(weights: list[torch.Tensor], rows: int, prologue: str | None = None, conv_channels: int = 0,
         epilogue: str | None = None) -> tuple[dict | None, dict]:  # fmt: skip
    """The fastest way to multiply `rows` rows by each of `weights` (one projection of every layer, all the same
    shape): None for cuBLAS, or skinny_linear's settings, searched in the stages TUNE_STAGES declares (below, in
    their order). Each candidate is timed as a CUDA graph running all the
    weights in turn, as a decode graph does, so launch overheads and L2 behave as they will. prologue: what the
    input is computed from, cuBLAS timed with the launches that compute it before it and skinny_linear with it
    fused (a chosen setting carries the flag): "silu" (`gated_linear`, flag gated), "norm" (`normed_linear`, after
    kernels.norm's launch for cuBLAS). conv_channels: the
    first that many outputs of each row go through a conv step after, on a state page of its own (timed as its own
    launch after cuBLAS, fused into skinny_linear: flag conv). epilogue "glu" (more than one row; weights
    [gate | up]): the result is silu(gate) * up, kernels.act.silu_mul after cuBLAS, fused into skinny_linear (flag
    glu: the launch gives the [rows, N / 2] product, see `glu_after`); epilogue "norm": the product is added to
    a residual stream by kernels.norm.add_rms_norm, whose launch is timed after every candidate, and the two fastest
    settings with K split are timed again with their partials left for that launch to add (flag defer; the pick
    then gives a `Partials`, see skinny_linear). At one row the candidates include
    whole-range tiles (`whole_range_candidates`, outputs of up to WHOLE_RANGE_MAX_N columns), and the three
    fastest candidates with a loop over K are timed again with the loop unrolled, then the fastest with its first
    weight tile loaded before the wait for the launch before (preload); at more rows the candidates include K
    split with the product as w @ x.T from 17 rows (SWAP_CANDIDATES, flag swap, after the prologue's own launch
    and before the conv's), the fastest candidate is timed again with preload, whether or not it beat cuBLAS, and
    with a prologue each candidate is also timed without it fused (the prologue's own launch first, and the conv's after
    where there is one; a pick without the flag runs so), and the two fastest with it fused are timed again with
    prefetch (the norm's fastest also with its sum of squares in tiles of 256 columns). The pick is checked against
    the unfused launches' result (and the conv's outputs), and dropped for cuBLAS if it differs by more than bf16
    rounding. Returns (choice, {description: seconds per weight, or the error of a setting that did not run or was
    wrong}). 16-bit weights only: the kernel's float32 products would round through TF32. The pick and its times are
    kept in the tuning cache (`TuneCache`), so the next process on this GPU with the same TUNE_VERSION and shapes
    skips the timing (the pick is still checked). Above CUBLAS_MARGIN_ROWS rows a pick must beat cuBLAS by
    CUBLAS_MARGIN."""
    N, K = weights[0].shape
    if weights[0].dtype not in (torch.bfloat16, torch.float16):
        return None, {}
    dev, dt = weights[0].device, weights[0].dtype
    glu = epilogue == "glu" and rows > 1
    norm_after = epilogue == "norm"
    x = torch.randn(rows, 2 * K if prologue == "silu" else K, device=dev, dtype=dt)
    out = torch.empty(rows, N // 2 if glu else N, device=dev, dtype=dt)
    res, res_out, nw = torch.randn_like(x), torch.empty_like(x), torch.randn(K, device=dev, dtype=dt) * 0.1
    conv = None
    if conv_channels:  # each row on a state page of its own
        C = conv_channels
        state = torch.randn(rows, C, 3, device=dev)
        pages = torch.arange(rows, dtype=torch.int32, device=dev)
        conv = (torch.randn(C, 4, device=dev, dtype=dt), state, pages, pages, torch.empty(rows, C, device=dev))

    # epilogue "norm": the residual stream the product is added to, its norm's weight and output
    stream, nw_after = torch.randn(rows, N, device=dev, dtype=dt), torch.randn(N, device=dev, dtype=dt) * 0.1
    normed = torch.empty_like(stream)

    def after(y, stream=stream):  # stream grows by y per call
        return norm_module.add_rms_norm(y, stream, nw_after, 1e-6, out=normed, offset=True) if norm_after else y

    def apply(w, settings, res=res, conv=conv, stream=stream):  # res grows by x per unfused norm
        y = prologue_linear(prologue, x, w, settings, (res, nw, 1e-6), conv)
        return glu_after(y, settings) if glu else after(y, stream)

    def fits(s):  # K cut in block_k tiles of every split
        return K % (s["block_k"] * s.get("splits", 1)) == 0

    def search() -> tuple[dict | None, dict]:
        times = {"cublas": graph_time(lambda: [apply(w, None) for w in weights], 10) / len(weights)}
        pflag = PROLOGUE_FLAGS.get(prologue)
        flag = {pflag: True} if pflag else {}
        if conv is not None:
            flag = dict(flag, conv=True)
        if glu:
            flag = dict(flag, glu=True)
        # K split only where the column blocks are few (each candidate is a compile at capture time)
        base = CANDIDATES[_kind(rows)] + (SPLIT_CANDIDATES[_kind(rows)] if N <= SPLIT_MAX_N else [])
        base += whole_range_candidates(K) if rows == 1 and N <= WHOLE_RANGE_MAX_N else []
        base = [s for s in base if fits(s)]
        settings: list[dict] = []
        candidates = [dict(s, **flag) for s in base]
        # more rows: the prologue also as its own launch before skinny_linear (the flag left out), since at 16 rows and
        # more a prologue computed in the product's loop can cost more than its launch (x passes through registers
        # on its way to the tensor cores, which stalls the loop's pipelined loads)
        if pflag and rows > 1:
            candidates += [dict(s, **{k: v for k, v in flag.items() if k != pflag}) for s in base]
            if conv is not None:  # and the conv step as its own launch after (no flag of either)
                candidates += [dict(s, **{k: v for k, v in flag.items() if k not in (pflag, "conv")}) for s in base]
        # K split with the product as w @ x.T, after the prologue's launch and before the conv's (it fuses neither)
        swap = SWAP_CANDIDATES.get(_kind(rows), []) if N <= SPLIT_MAX_N and not glu else []
        candidates += [dict(s, **{k: v for k, v in flag.items() if k not in (pflag, "conv")}) for s in swap if fits(s)]
        extra = {"norm": dict(norm=(res, nw, 1e-6, res_out))}.get(prologue, {})
        if conv is not None:
            extra = dict(extra, conv=conv)

        def run(s):
            if pflag and not s.get(pflag):
                return [apply(w, dict(s, out=out)) for w in weights]
            return [after(_skinny(x, w, dict(s, out=out), **extra)) for w in weights]

        ctx, best = TuneContext(rows, K, prologue, pflag, norm_after, candidates), None
        for stage in TUNE_STAGES:  # each stage times what it proposes from what the stages before it timed
            proposed = stage.propose(ctx, settings, times, best) if stage.when(ctx) else []
            if proposed:
                best, times = fastest(proposed, run, len(weights), best, time_of(best, times), times)
                settings += proposed
        if best is not None and rows > CUBLAS_MARGIN_ROWS and times[str(best)] > times["cublas"] * (1 - CUBLAS_MARGIN):
            best = None  # within the margin of cuBLAS: cuBLAS
        return best, times

    key = _tune_key(weights, rows, prologue, conv_channels, epilogue)
    cached = tune_cache().get(key)
    best, times = (cached["choice"], dict(cached["times"])) if cached is not None else search()

    def results(settings) -> list[tuple[str, torch.Tensor]]:
        """The output (and the conv's), from fresh copies of what a call updates."""
        c = None if conv is None else (conv[0], state.clone(), pages, pages, torch.empty_like(conv[4]))
        y = apply(weights[0], settings, res.clone(), c, stream.clone()).float()
        return [("", y)] + ([(" (conv outputs)", c[4])] if c is not None else [])

    if best is not None:
        # the pick must give what the unfused launches give, within bf16 rounding (the conv's float32 outputs
        # too): a setting that runs fast and wrong (a kernel path no test has run on this GPU) is dropped for
        # cuBLAS, its time kept with the reason
        for (what, want), (_, got) in zip(results(None), results(best)):
            err, scale = (got - want).abs().max().item(), want.abs().max().item()
            if not err <= 0.02 * scale + 1e-3:
                times[str(best)] = f"wrong result{what}: max error {err:.3g} of {scale:.3g}"
                best = None
                break
    if cached is None or best != cached["choice"]:  # timed here, or the cached pick failed the check
        tune_cache().put(key, best, times)
    return best, times


def by_time(settings: list[dict], times: dict, keep=lambda s: True) -> list[dict]:
    """The settings that `keep` accepts and that ran (a time in `times`, as `fastest` records them), fastest first,
    ties in list order."""
    timed = sorted((t, i) for i, s in enumerate(settings) if keep(s) and isinstance(t := times.get(str(s)), float))
    return [settings[i] for _, i in timed]


def time_of(best: dict | None, times: dict) -> float:
    """The time `times` holds for the pick so far: best's, or cuBLAS's where best is None."""
    return times[str(best)] if best is not None else times["cublas"]


def fastest(settings: list[dict], run, per: int, best=None, best_t: float = float("inf"), times=None):
    """Each setting's run(setting) timed as a CUDA graph (seconds per weight: the replay over `per`); a setting that
    does not run (e.g. triton's OutOfResources: more shared memory than there is) is recorded with its error.
    Returns (the fastest setting, or `best` when none beats `best_t`; {str(setting): seconds or error})."""
    times = {} if times is None else times
    for s in settings:
        try:
            t = graph_time(lambda s=s: run(s), 10) / per
        except Exception as e:
            times[str(s)] = repr(e)[:200]
            continue
        times[str(s)] = t
        if t < best_t:
            best, best_t = s, t
    return best, times
