"""Gated delta rule kernels for the hybrid (Qwen3-Next) model's linear-attention layers, reading and writing each
request's recurrent state in place in its state page (the PyTorch reference: backends.common.delta_rule).

- `recurrent_step`: one decode token for B sequences. One program per (sequence, value head, block of value
  dims) loads its [key dim, block] slice of the state once, applies decay, delta update and read-out, and stores
  it once: the state is read and written exactly once per step, the bound the benchmark measures against.
- `chunked`: prefill of several sequences of any lengths (varlen), chunk by chunk of 64 tokens. Within a chunk
  the delta-rule updates are folded into (I + A)^-1 with A = strictly_lower(beta k k^T * decay); A is nilpotent,
  so the inverse is the finite product (I - A)(I + A^2)(I + A^4)...(I + A^32): five squarings, all tensor-core
  matmuls, no row-by-row substitution. One program per (sequence, value head, block of value dims) carries the
  state across chunks in registers.

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
def _chunked_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, s_ptr, pages_ptr, starts_ptr, lens_ptr,
    s_page, s_head, s_k,
    H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, LOG2C: tl.constexpr,
):  # fmt: skip
    n, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    page = tl.load(pages_ptr + n).to(tl.int64)
    start = tl.load(starts_ptr + n).to(tl.int64)
    length = tl.load(lens_ptr + n)
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    rc = tl.arange(0, C)
    mk, mv = rk < DK, rv < DV
    sp = s_ptr + page * s_page + h * s_head + rk[:, None] * s_k + rv[None, :]
    s = tl.load(sp, mask=mk[:, None] & mv[None, :], other=0.0)
    lower = rc[:, None] >= rc[None, :]
    strict = rc[:, None] > rc[None, :]
    eye = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0)
    for c0 in range(0, length, C):
        m = (c0 + rc) < length
        rows = start + c0 + rc
        qk_off = (rows[:, None] * H + h) * DK + rk[None, :]
        mq = m[:, None] & mk[None, :]
        kc = tl.load(k_ptr + qk_off, mask=mq, other=0.0)
        qc = tl.load(q_ptr + qk_off, mask=mq, other=0.0)
        vc = tl.load(v_ptr + (rows[:, None] * H + h) * DV + rv[None, :], mask=m[:, None] & mv[None, :], other=0.0)
        gc = tl.load(g_ptr + rows * H + h, mask=m, other=0.0)
        bc = tl.load(beta_ptr + rows * H + h, mask=m, other=0.0)
        cum = tl.cumsum(gc, axis=0)
        decay = tl.where(lower, tl.exp(tl.where(lower, cum[:, None] - cum[None, :], 0.0)), 0.0)
        kb = kc * bc[:, None]
        a = tl.where(strict, tl.dot(kb, tl.trans(kc), input_precision="ieee") * decay, 0.0)
        # (I + a)^-1 = (I - a)(I + a^2)(I + a^4)...: a is strictly lower triangular, so a^C = 0
        inv = eye - a
        p = a
        for _ in tl.static_range(LOG2C - 1):
            p = tl.dot(p, p, input_precision="ieee")
            inv = tl.dot(inv, eye + p, input_precision="ieee")
        u = tl.dot(inv, vc * bc[:, None], input_precision="ieee")
        w = tl.dot(inv, kb * tl.exp(cum)[:, None], input_precision="ieee")
        v_new = u - tl.dot(w, s, input_precision="ieee")
        attn = tl.dot(qc, tl.trans(kc), input_precision="ieee") * decay
        out = tl.dot(qc * tl.exp(cum)[:, None], s, input_precision="ieee") + tl.dot(attn, v_new, input_precision="ieee")
        tl.store(o_ptr + (rows[:, None] * H + h) * DV + rv[None, :], out, mask=m[:, None] & mv[None, :])
        last = tl.sum(tl.where(rc == C - 1, cum, 0.0), axis=0)  # padded rows have g = 0: cum stays put
        kd = kc * tl.exp(last - cum)[:, None]
        s = s * tl.exp(last) + tl.dot(tl.trans(kd), v_new, input_precision="ieee")
    tl.store(sp, s, mask=mk[:, None] & mv[None, :])


def chunked(q, k, v, g, beta, state: torch.Tensor, pages, starts, lens) -> torch.Tensor:
    """Sequences i = 0..N-1 own rows [starts[i], starts[i] + lens[i]) of q, k: [T, H, DK], v: [T, H, DV], g, beta:
    [T, H] (float32, contiguous) and start from (and end in) state page pages[i] of state [pages, H, DK, DV].
    pages, starts, lens: int tensors [N] on the device. Returns o [T, H, DV]."""
    T, H, DK = q.shape
    DV = v.shape[-1]
    o = torch.zeros_like(v)
    if T == 0 or pages.numel() == 0:
        return o
    bk = max(16, triton.next_power_of_2(DK))
    bv = max(16, min(triton.next_power_of_2(DV), 32 if bk > 64 else 64))
    sp, sh, sk = _state_strides(state)
    _chunked_kernel[(pages.numel(), H, triton.cdiv(DV, bv))](
        q, k, v, g, beta, o, state, pages, starts, lens, sp, sh, sk,
        H=H, DK=DK, DV=DV, BK=bk, BV=bv, C=CHUNK, LOG2C=6, num_warps=4,
    )  # fmt: skip
    return o
