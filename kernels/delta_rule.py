"""Gated delta rule kernels for the hybrid (Qwen3-Next) model's linear-attention layers, reading and writing each
request's recurrent state in place in its state page (the PyTorch reference: backends.common.delta_rule).

- `recurrent_step`: one decode token for B sequences. One program per (sequence, value head, block of value
  dims) loads its [key dim, block] slice of the state once, applies decay, delta update and read-out, and stores
  it once: the state is read and written exactly once per step, the bound the benchmark measures against.
- `chunked`: prefill of several sequences of any lengths (varlen) in chunks of 64 tokens. The chunk algebra that
  does not depend on the state (the WY form of each chunk's delta-rule updates) runs for all chunks at once in
  batched PyTorch ops; one kernel launch then carries each sequence's state across its chunks in registers, one
  program per (sequence, value head, block of value dims), four matmuls per chunk.

Inputs are float32: q, k already L2-normalised (q scaled by key_dim^-1/2), one row per value head."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 64


@triton.jit
def _recurrent_step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, s_ptr, pages_ptr,
    s_page, s_head, s_k,
    H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    page = tl.load(pages_ptr + b).to(tl.int64)
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    mk, mv = rk < DK, rv < DV
    row = b * H + h
    q = tl.load(q_ptr + row * DK + rk, mask=mk, other=0.0)
    k = tl.load(k_ptr + row * DK + rk, mask=mk, other=0.0)
    v = tl.load(v_ptr + row * DV + rv, mask=mv, other=0.0)
    g = tl.load(g_ptr + row)
    beta = tl.load(beta_ptr + row)
    sp = s_ptr + page * s_page + h * s_head + rk[:, None] * s_k + rv[None, :]
    m2 = mk[:, None] & mv[None, :]
    s = tl.load(sp, mask=m2, other=0.0) * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(sp, s, mask=m2)
    tl.store(o_ptr + row * DV + rv, tl.sum(s * q[:, None], axis=0), mask=mv)


def _state_strides(state: torch.Tensor) -> tuple[int, int, int]:
    if state.stride(-1) != 1:
        raise ValueError("state pages need a contiguous value dimension")
    return state.stride(0), state.stride(1), state.stride(2)


def _block_v(dv: int, bk: int) -> int:
    """Value dims per program: keeps the state tile [bk, bv] within a register budget of about 8k floats."""
    return max(16, min(triton.next_power_of_2(dv), 8192 // bk))


def recurrent_step(q, k, v, g, beta, state: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """q, k: [B, H, DK]; v: [B, H, DV]; g, beta: [B, H] (float32, contiguous); state: [pages, H, DK, DV] float32,
    updated in place at rows `pages` [B]. Returns o [B, H, DV]."""
    B, H, DK = q.shape
    DV = v.shape[-1]
    o = torch.empty_like(v)
    if B == 0:
        return o
    bk = triton.next_power_of_2(DK)
    bv = _block_v(DV, bk)
    sp, sh, sk = _state_strides(state)
    _recurrent_step_kernel[(B, H, triton.cdiv(DV, bv))](
        q, k, v, g, beta, o, state, pages, sp, sh, sk, H=H, DK=DK, DV=DV, BK=bk, BV=bv, num_warps=4
    )
    return o


@triton.jit
def _chunk_scan_kernel(
    u_ptr, w_ptr, qd_ptr, kd_ptr, attn_ptr, last_ptr, o_ptr, s_ptr, pages_ptr, first_ptr, count_ptr,
    s_page, s_head, s_k, M,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
):  # fmt: skip
    """Chunk tensors are [H, M, C, .] contiguous (chunk_prep's layout); sequence n owns chunks
    [first[n], first[n] + count[n])."""
    n, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    page = tl.load(pages_ptr + n).to(tl.int64)
    first = tl.load(first_ptr + n).to(tl.int64)
    count = tl.load(count_ptr + n)
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    rc = tl.arange(0, C)
    mk, mv = rk < DK, rv < DV
    sp = s_ptr + page * s_page + h * s_head + rk[:, None] * s_k + rv[None, :]
    s = tl.load(sp, mask=mk[:, None] & mv[None, :], other=0.0)
    for c in range(0, count):
        chunk = h * M + first + c  # chunk index in [H, M]
        ck = chunk * C * DK + rc[:, None] * DK + rk[None, :]
        cv = chunk * C * DV + rc[:, None] * DV + rv[None, :]
        w = tl.load(w_ptr + ck, mask=mk[None, :], other=0.0)
        qd = tl.load(qd_ptr + ck, mask=mk[None, :], other=0.0)
        kd = tl.load(kd_ptr + ck, mask=mk[None, :], other=0.0)
        u = tl.load(u_ptr + cv, mask=mv[None, :], other=0.0)
        attn = tl.load(attn_ptr + chunk * C * C + rc[:, None] * C + rc[None, :])
        last = tl.load(last_ptr + chunk)
        v_new = u - tl.dot(w, s, input_precision="ieee")
        out = tl.dot(qd, s, input_precision="ieee") + tl.dot(attn, v_new, input_precision="ieee")
        tl.store(o_ptr + cv, out, mask=mv[None, :])
        s = s * last + tl.dot(tl.trans(kd), v_new, input_precision="ieee")
    tl.store(sp, s, mask=mk[:, None] & mv[None, :])


def chunked(q, k, v, g, beta, state: torch.Tensor, pages, starts, lens) -> torch.Tensor:
    """Sequences i = 0..N-1 own rows [starts[i], starts[i] + lens[i]) of q, k: [T, H, DK], v: [T, H, DV], g, beta:
    [T, H] (float32) and start from (and end in) state page pages[i] of state [pages, H, DK, DV]. pages: an int
    tensor [N] on the device; starts, lens: lists (or tensors) of ints. Returns o [T, H, DV].

    Two phases: the state-independent chunk algebra for every chunk of every sequence at once, in batched PyTorch
    matmuls and triangular solves (backends.common.delta_rule.chunk_prep, each sequence padded to whole chunks),
    then one kernel launch that carries each sequence's state across its chunks in registers."""
    from backends.common.delta_rule import chunk_prep

    T, H, DK = q.shape
    DV = v.shape[-1]
    if T == 0 or pages.numel() == 0:
        return torch.zeros_like(v)
    starts, lens = [int(x) for x in starts], [int(x) for x in lens]
    counts = [triton.cdiv(n, CHUNK) for n in lens]
    firsts = [sum(counts[:i]) for i in range(len(counts))]
    # rows of the padded layout: each sequence's rows, then -1 (a zero row) up to a whole chunk
    idx = torch.full((sum(counts) * CHUNK,), T, dtype=torch.int64)
    for s0, n, f in zip(starts, lens, firsts):
        idx[f * CHUNK : f * CHUNK + n] = torch.arange(s0, s0 + n)
    idx = idx.to(q.device)

    def padded(x):
        return torch.cat((x, x.new_zeros((1, *x.shape[1:]))))[idx]

    u, w, qd, kd, attn, last = (t.contiguous() for t in chunk_prep(*(padded(x) for x in (q, k, v, g, beta)), CHUNK))
    M = u.shape[1]
    o = torch.empty_like(u)
    bk = max(16, triton.next_power_of_2(DK))
    bv = max(16, min(triton.next_power_of_2(DV), 32 if bk > 64 else 64))
    sp, sh, sk = _state_strides(state)
    dev = q.device
    _chunk_scan_kernel[(len(lens), H, triton.cdiv(DV, bv))](
        u, w, qd, kd, attn, last, o, state, pages,
        torch.tensor(firsts, device=dev), torch.tensor(counts, device=dev), sp, sh, sk, M,
        DK=DK, DV=DV, BK=bk, BV=bv, C=CHUNK, num_warps=4, num_stages=1,  # no pipelining: the tiles fill shared memory
    )  # fmt: skip
    out = torch.empty_like(v)
    out[idx[idx < T]] = o.permute(1, 2, 0, 3).reshape(-1, H, DV)[idx < T]
    return out


# ---- the decode step of a linear-attention layer, fused for CUDA graphs (backends.common.gpu_hybrid) ----------
@triton.jit
def _conv_step_kernel(
    X, W, S, Out, Pages, stride_x, stride_o, s_page, C,
    KM1: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Depthwise causal conv over one new input per sequence, then SiLU. X [B, >= C] (the projection's first C
    columns), W [C, KM1 + 1], S: conv state rows [pages, C, KM1] (page stride s_page), Out [B, C] float32. Every
    load comes before any store, so the loads are not ordered behind the stores."""
    b, cb = tl.program_id(0), tl.program_id(1)
    page = tl.load(Pages + b).to(tl.int64)
    offs = cb * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    taps = tl.arange(0, KM1 + 1)  # KM1 + 1 is a power of two (the conv kernel: 4)
    tmask = mask[:, None] & (taps[None, :] < KM1)
    x = tl.load(X + b.to(tl.int64) * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    sp = S + page * s_page + offs[:, None] * KM1 + taps[None, :]
    prev = tl.load(sp, mask=tmask, other=0.0)  # [BLOCK, KM1 + 1]: the kept inputs, oldest first, then a 0
    # the new state: the kept inputs after the oldest, then x
    nxt = tl.load(sp + 1, mask=mask[:, None] & (taps[None, :] < KM1 - 1), other=0.0)
    nxt = tl.where(taps[None, :] == KM1 - 1, x[:, None], nxt)
    w = tl.load(W + offs[:, None] * (KM1 + 1) + taps[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
    acc = tl.sum(tl.where(taps[None, :] == KM1, x[:, None], prev) * w, 1)
    tl.store(sp, nxt, mask=tmask)
    tl.store(Out + b.to(tl.int64) * stride_o + offs, acc / (1.0 + tl.exp(-acc)), mask=mask)


def conv_step(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, pages: torch.Tensor, out=None):
    """x: [B, >= C] (its first C columns are the conv inputs, any dtype); weight [C, K] with K a power of two;
    conv_state [pages, C, K-1] float32, a view with unit stride inside a page, updated in place at rows `pages`
    [B]. Returns float32 [B, C]."""
    B = x.shape[0]
    C, K = weight.shape
    assert conv_state.stride(2) == 1 and conv_state.stride(1) == K - 1 and x.stride(1) == 1 and K & (K - 1) == 0
    if out is None:
        out = torch.empty(B, C, dtype=torch.float32, device=x.device)
    if B == 0:
        return out
    block = 256
    _conv_step_kernel[(B, triton.cdiv(C, block))](
        x, weight, conv_state, out, pages, x.stride(0), out.stride(0), conv_state.stride(0), C,
        KM1=K - 1, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _gated_delta_step_kernel(
    Mixed, Proj, ALog, DtBias, NormW, Out, S, Pages,
    stride_m, stride_p, stride_out, s_page, s_head, s_k, z_off, b_off, a_off, eps, q_scale,
    HV: tl.constexpr, R: tl.constexpr, KD: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, value head): the head's [DK, DV] state in NV blocks of BV value dims, each
    loaded, updated, stored and read out in turn; then the gated RMSNorm over all DV outputs."""
    b, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    page = tl.load(Pages + b).to(tl.int64)
    kh = h // R  # the key head this value head reads (q and k repeat_interleave'd by R)
    rk = tl.arange(0, BK)
    mk = rk < DK
    mrow = Mixed + b * stride_m
    q = tl.load(mrow + kh * DK + rk, mask=mk, other=0.0)
    k = tl.load(mrow + KD + kh * DK + rk, mask=mk, other=0.0)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * q_scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    prow = Proj + b * stride_p
    beta = tl.sigmoid(tl.load(prow + b_off + h).to(tl.float32))
    a = tl.load(prow + a_off + h).to(tl.float32) + tl.load(DtBias + h).to(tl.float32)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
    decay = tl.exp(-tl.exp(tl.load(ALog + h).to(tl.float32)) * softplus)
    dt = Out.dtype.element_ty
    orow = Out + b * stride_out + h * DV
    sumsq = 0.0
    for vb in tl.static_range(NV):
        rv = vb * BV + tl.arange(0, BV)
        mv = rv < DV
        v = tl.load(mrow + 2 * KD + h * DV + rv, mask=mv, other=0.0)
        sp = S + page * s_page + h * s_head + rk[:, None] * s_k + rv[None, :]
        m2 = mk[:, None] & mv[None, :]
        s = tl.load(sp, mask=m2, other=0.0) * decay
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        tl.store(sp, s, mask=m2)
        o = tl.sum(s * q[:, None], axis=0).to(dt)  # the core output, rounded as the PyTorch model rounds it
        tl.store(orow + rv, o, mask=mv)
        of = o.to(tl.float32)
        sumsq += tl.sum(tl.where(mv, of * of, 0.0), 0)
    rstd = tl.rsqrt(sumsq / DV + eps)
    tl.debug_barrier()  # the raw outputs this program stored are visible to all of its threads
    for vb in tl.static_range(NV):
        rv = vb * BV + tl.arange(0, BV)
        mv = rv < DV
        y = (tl.load(orow + rv, mask=mv, other=0.0).to(tl.float32) * rstd).to(dt)
        y = (tl.load(NormW + rv, mask=mv, other=0.0) * y).to(tl.float32)
        z = tl.load(prow + z_off + h * DV + rv, mask=mv, other=0.0).to(tl.float32)
        tl.store(orow + rv, (y * (z / (1.0 + tl.exp(-z)))).to(dt), mask=mv)


def step_block_v(batch: int) -> int:
    """`gated_delta_step`'s block of value dims for a batch: whole 128-dim heads for a few sequences, 64 from 16
    up (perf/hybrid_sweep.py on an H200, Qwen3-Next's shapes: 146 against 150 µs at batch 128, 41 against 42 at
    32, 4.8 against 5.2 at 1)."""
    return 128 if batch < 16 else 64


def gated_delta_step(
    mixed: torch.Tensor, proj: torch.Tensor, a_log, dt_bias, norm_w, state: torch.Tensor, pages: torch.Tensor,
    num_key_heads: int, eps: float, out: torch.Tensor | None = None, block_v: int = 64, num_warps: int = 4,
) -> torch.Tensor:  # fmt: skip
    """The rest of a linear-attention layer's decode step after the conv, in one launch: L2 norms of q and k
    (q scaled by DK^-1/2), the gates beta = sigmoid(b) and g = -exp(A_log) softplus(a + dt_bias), the delta-rule
    update of the state page in place, the read-out and the gated RMSNorm with z.

    mixed: [B, 2 * Hk * DK + HV * DV] float32 (conv output: q, k, v of every head); proj: [B, >= a_off + HV] (the
    projection, columns [z (HV * DV) | b (HV) | a (HV)] from z_off = mixed's width); state [pages, HV, DK, DV]
    float32. block_v: value dims per block of the state tile (a [DK, block_v] float32 tile in registers).
    Returns [B, HV * DV] in proj's dtype."""
    B = mixed.shape[0]
    HV, DK, DV = state.shape[1:]
    KD = num_key_heads * DK
    z_off = 2 * KD + HV * DV
    if out is None:
        out = torch.empty(B, HV * DV, dtype=proj.dtype, device=proj.device)
    if B == 0:
        return out
    sp, sh, sk = _state_strides(state)
    bk = triton.next_power_of_2(DK)
    bv = min(triton.next_power_of_2(DV), block_v)
    _gated_delta_step_kernel[(B, HV)](
        mixed, proj, a_log, dt_bias, norm_w, out, state, pages,
        mixed.stride(0), proj.stride(0), out.stride(0), sp, sh, sk, z_off, z_off + HV * DV, z_off + HV * DV + HV, eps,
        DK**-0.5, HV=HV, R=HV // num_key_heads, KD=KD, DK=DK, DV=DV, BK=bk, BV=bv, NV=triton.cdiv(DV, bv),
        num_warps=num_warps,
    )  # fmt: skip
    return out
