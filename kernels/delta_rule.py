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
