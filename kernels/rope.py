"""Rotary position embedding applied in place to q and k, in Triton (the half-split layout: element i pairs with
i + D/2). cos/sin come from a float32 cache [max_position, D/2] built once from the model's inverse frequencies.
`rope_store_kv_` does the same and also writes the rotated k and v into the KV pool: one kernel per layer instead
of two."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import enter, launch


@triton.jit
def _rotate(src, stride_h, dst, dst_stride_h, nh, c, s, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """Rotate nh heads at src (stride_h apart) into dst (dst_stride_h apart); dst may be src (in place)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < nh)[:, None]
    p1 = src + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    y1 = x1.to(tl.float32) * c - x2.to(tl.float32) * s
    y2 = x2.to(tl.float32) * c + x1.to(tl.float32) * s
    d1 = dst + offs_h[:, None] * dst_stride_h + offs_d[None, :]
    tl.store(d1, y1.to(dst.dtype.element_ty), mask=mask)
    tl.store(d1 + HALF, y2.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, Pos, Cos, Sin, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
    HQ: tl.constexpr, HK: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    c = tl.load(Cos + pos * stride_c + offs_d)[None, :]
    s = tl.load(Sin + pos * stride_c + offs_d)[None, :]
    _rotate(Q + t * stride_qt, stride_qh, Q + t * stride_qt, stride_qh, HQ, c, s, BLOCK_H, HALF)
    _rotate(K + t * stride_kt, stride_kh, K + t * stride_kt, stride_kh, HK, c, s, BLOCK_H, HALF)


@triton.jit
def _rope_store_kernel(
    Q, K, V, Pos, Cos, Sin, KP, VP, Slots, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_c,
    stride_ps, HQ: tl.constexpr, HK: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    c = tl.load(Cos + pos * stride_c + offs_d)[None, :]
    s = tl.load(Sin + pos * stride_c + offs_d)[None, :]
    _rotate(Q + t * stride_qt, stride_qh, Q + t * stride_qt, stride_qh, HQ, c, s, BLOCK_H, HALF)
    _rotate(K + t * stride_kt, stride_kh, KP + slot * stride_ps, 2 * HALF, HK, c, s, BLOCK_H, HALF)
    offs = tl.arange(0, BLOCK_V)
    mask = offs < HK * 2 * HALF
    tl.store(VP + slot * stride_ps + offs, tl.load(V + t * stride_vt + offs, mask=mask), mask=mask)


def rope_cache(inv_freq: torch.Tensor, max_position: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [max_position, D/2], the same float32 angles as the PyTorch model computes."""
    freqs = torch.arange(max_position, device=device, dtype=torch.float32)[:, None] * inv_freq.to(device)[None, :]
    return freqs.cos().contiguous(), freqs.sin().contiguous()


def apply_rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q: [T, Hq, D], k: [T, Hk, D] (views with unit stride on D), rotated in place; positions: [T] int."""
    T, HQ, D = q.shape
    HK = k.shape[1]
    if T == 0:
        return
    _rope_kernel[(T,)](
        q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        HQ=HQ, HK=HK, BLOCK_H=triton.next_power_of_2(max(HQ, HK)), HALF=D // 2, num_warps=4,
    )  # fmt: skip


def rope_store_kv_(q, k, v, positions, cos, sin, k_pool, v_pool, slots):
    """Rotate q in place; write rotated k and v into k_pool/v_pool [S, Hkv, D] at `slots` ([T] int). k itself is
    left as it was. q, k: as for `apply_rope_`; v: [T, Hkv, D] with rows of unit stride inside a token."""
    T, HQ, D = q.shape
    HK = k.shape[1]
    if T == 0:
        return
    assert v.stride(1) == D and k_pool.stride(0) == v_pool.stride(0) == HK * D and k_pool.stride(1) == D
    _rope_store_kernel[(T,)](
        q, k, v, positions, cos, sin, k_pool, v_pool, slots, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), cos.stride(0), k_pool.stride(0),
        HQ=HQ, HK=HK, BLOCK_H=triton.next_power_of_2(max(HQ, HK)), HALF=D // 2,
        BLOCK_V=triton.next_power_of_2(HK * D), num_warps=4,
    )  # fmt: skip


@triton.jit
def cos_sin(Cos, Sin, pos, stride_c, offs_d, R: tl.constexpr):
    """The rotation at position pos for dims offs_d, of which the first R rotate (half-split within them: d pairs
    with d +- R/2): cos, and sin signed for the element it multiplies; 1 and 0 beyond R."""
    HALF: tl.constexpr = R // 2
    rmask = offs_d < R
    c = tl.load(Cos + pos * stride_c + offs_d % HALF, mask=rmask, other=1.0)
    sn = tl.load(Sin + pos * stride_c + offs_d % HALF, mask=rmask, other=0.0)
    return c, tl.where(offs_d < HALF, -sn, sn)


@triton.jit
def _norm_partial_rope(src, stride_h, w_ptr, nh, c, sn, eps, D: tl.constexpr, R: tl.constexpr,
                       BLOCK_H: tl.constexpr):  # fmt: skip
    """nh heads at src: RMSNorm over D with weight (1 + w) (rounded to the activation dtype), then the rotary
    embedding on the first R dims (half-split within them: d pairs with d +- R/2). Returns [BLOCK_H, D] float32."""
    HALF: tl.constexpr = R // 2
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    partner = tl.where(offs_d < HALF, offs_d + HALF, tl.where(offs_d < R, offs_d - HALF, offs_d))
    mask = (offs_h < nh)[:, None]
    rows = src + offs_h[:, None] * stride_h
    x = tl.load(rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
    dt = src.dtype.element_ty
    xn = (x * rstd * (1.0 + tl.load(w_ptr + offs_d).to(tl.float32))[None, :]).to(dt).to(tl.float32)
    xpn = (xp * rstd * (1.0 + tl.load(w_ptr + partner).to(tl.float32))[None, :]).to(dt).to(tl.float32)
    rot = xn * c[None, :] + xpn * sn[None, :]
    return tl.where((offs_d < R)[None, :], rot, xn)


@triton.jit
def _qk_norm_rope_store_kernel(
    QKV, QOut, QW, KW, Pos, Cos, Sin, KP, VP, Slots, stride_t, stride_qo, stride_c, stride_ps, k_off, v_off, eps,
    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    offs_d = tl.arange(0, D)
    c, sn = cos_sin(Cos, Sin, pos, stride_c, offs_d, R)
    row = QKV + t * stride_t
    offs_h = tl.arange(0, BLOCK_H)
    dt = QOut.dtype.element_ty
    q = _norm_partial_rope(row, D, QW, HQ, c, sn, eps, D, R, BLOCK_H)
    tl.store(QOut + t * stride_qo + offs_h[:, None] * D + offs_d[None, :], q.to(dt), mask=(offs_h < HQ)[:, None])
    k = _norm_partial_rope(row + k_off, D, KW, HK, c, sn, eps, D, R, BLOCK_H)
    kmask = (offs_h < HK)[:, None]
    dst = offs_h[:, None] * D + offs_d[None, :]
    tl.store(KP + slot * stride_ps + dst, k.to(dt), mask=kmask)
    tl.store(VP + slot * stride_ps + dst, tl.load(row + v_off + dst, mask=kmask), mask=kmask)


def qk_norm_rope_store_kv_(qkv, num_heads, num_kv_heads, q_w, k_w, eps, positions, cos, sin, k_pool, v_pool, slots,
                           q_out=None):  # fmt: skip
    """A gated full-attention layer's q and k (Qwen3-Next): per-head RMSNorm with weight (1 + w), then the rotary
    embedding on the first 2 * cos.shape[1] dims. qkv: [T, >= ...] rows holding q [H * D] at column 0, k [Hkv * D]
    at column 2 * H * D (after the gate) and v right after k. Writes q into q_out [T, H, D] (returned), the rotated
    k and v into k_pool/v_pool [S, Hkv, D] at `slots` [T]."""
    T = qkv.shape[0]
    D = k_pool.shape[-1]
    if q_out is None:
        q_out = torch.empty(T, num_heads, D, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q_out
    assert qkv.stride(1) == 1 and k_pool.stride(0) == v_pool.stride(0) == num_kv_heads * D and q_out.is_contiguous()
    k_off = 2 * num_heads * D
    _qk_norm_rope_store_kernel[(T,)](
        qkv, q_out, q_w, k_w, positions, cos, sin, k_pool, v_pool, slots, qkv.stride(0), q_out.stride(0),
        cos.stride(0), k_pool.stride(0), k_off, k_off + num_kv_heads * D, eps,
        HQ=num_heads, HK=num_kv_heads, D=D, R=2 * cos.shape[1], BLOCK_H=triton.next_power_of_2(num_heads),
        num_warps=4, **launch(qkv),
    )  # fmt: skip
    return q_out
