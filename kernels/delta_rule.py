"""Gated delta rule kernels for the hybrid (Qwen3-Next) model's linear-attention layers, reading and writing each
request's recurrent state in place in its state page (the PyTorch reference: backends.common.model.delta_rule).

- `recurrent_step`: one decode token for B sequences. One program per (sequence, value head, block of value
  dims) loads its [key dim, block] slice of the state once, applies decay, delta update and read-out, and stores
  it once: the state is read and written exactly once per step, the bound the benchmark measures against.
- `chunked`: prefill of several sequences of any lengths (varlen) in chunks of 64 tokens, in three launches: the
  chunk algebra that does not depend on the state (each chunk's delta-rule updates folded into one triangular
  inverse, the WY form) for every chunk at once; the state carried across each sequence's chunks, one program
  per (sequence, value head, block of value dims), two matmuls per chunk, storing the state each chunk starts
  from; every chunk's read-out in parallel.

Inputs are float32: q, k already L2-normalised (q scaled by key_dim^-1/2), one row per value head."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import enter, launch

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
def _chunk_state_kernel(
    u_ptr, w_ptr, kd_ptr, last_ptr, h_ptr, vn_ptr, s_ptr, pages_ptr, first_ptr, count_ptr,
    s_page, s_head, s_k, M,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """The sequential part: chunk tensors are [H, M, C, .] contiguous (chunk_prep's layout); sequence n owns chunks
    [first[n], first[n] + count[n]). Per chunk it stores the state the chunk starts from (h: [H, M, DK, DV]) and
    the chunk's corrected values v_new = u - w S, then S <- S * last + k_dec^T v_new: two matmuls per chunk."""
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
        tl.store(h_ptr + chunk * DK * DV + rk[:, None] * DV + rv[None, :], s, mask=mk[:, None] & mv[None, :])
        ck = chunk * C * DK + rc[:, None] * DK + rk[None, :]
        cv = chunk * C * DV + rc[:, None] * DV + rv[None, :]
        w = tl.load(w_ptr + ck, mask=mk[None, :], other=0.0)
        u = tl.load(u_ptr + cv, mask=mv[None, :], other=0.0)
        v_new = u - tl.dot(w, s, input_precision=PREC)
        tl.store(vn_ptr + cv, v_new, mask=mv[None, :])
        kd = tl.load(kd_ptr + ck, mask=mk[None, :], other=0.0)
        last = tl.load(last_ptr + chunk)
        s = s * last + tl.dot(tl.trans(kd), v_new, input_precision=PREC)
    tl.store(sp, s, mask=mk[:, None] & mv[None, :])


@triton.jit
def _chunk_prep_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, row0_ptr, len_ptr,
    u_ptr, w_ptr, qd_ptr, kd_ptr, attn_ptr, last_ptr, H, M,
    stride_m, stride_ab, a_log_ptr, dt_bias_ptr, q_scale,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    PREC: tl.constexpr, RAW: tl.constexpr, R: tl.constexpr, KD: tl.constexpr,
):  # fmt: skip
    """The state-independent chunk algebra (backends.common.model.delta_rule.chunk_prep) for chunk m of head h, read
    straight from the [T, H, .] rows: chunk m covers rows [row0[m], row0[m] + len[m]) (len <= C; the rest is
    padding with k = v = beta = g = 0, which leaves the state as it is). Within the chunk the delta-rule updates
    fold into (I + A)^-1 with A = strictly_lower((beta k) k^T * decay), inverted here in blocks of 16.
    RAW: q, k, v are read from the conv output's rows (q_ptr: [T, 2 KD + H DV] float32, row stride stride_m; value
    head h reads key head h // R), q and k L2-normalised here (q times q_scale); g and beta computed here from the
    projection's a (g_ptr) and b (beta_ptr) columns (row stride stride_ab) as -exp(A_log) softplus(a + dt_bias) and
    sigmoid(b): what HybridModel._qkv_gates computes, without its tensors."""
    tl.static_assert(C == 64)  # four blocks of 16 below
    m, h = tl.program_id(0), tl.program_id(1)
    row0 = tl.load(row0_ptr + m).to(tl.int64)
    n = tl.load(len_ptr + m)
    rc = tl.arange(0, C)
    rk = tl.arange(0, BK)
    rv = tl.arange(0, BV)
    valid = rc < n
    mk, mv = rk < DK, rv < DV
    if RAW:
        t = row0 + rc
        kh = h // R
        qrows = q_ptr + t[:, None] * stride_m + kh * DK + rk[None, :]
        k = tl.load(qrows + KD, mask=valid[:, None] & mk[None, :], other=0.0)
        k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
        v = tl.load(q_ptr + t[:, None] * stride_m + 2 * KD + h * DV + rv[None, :], mask=valid[:, None] & mv[None, :],
                    other=0.0)  # fmt: skip
        a = tl.load(g_ptr + t * stride_ab + h, mask=valid, other=0.0).to(tl.float32)
        a = a + tl.load(dt_bias_ptr + h).to(tl.float32)
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
        g = tl.where(valid, -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus, 0.0)
        b = tl.load(beta_ptr + t * stride_ab + h, mask=valid, other=0.0).to(tl.float32)
        beta = tl.where(valid, 1.0 / (1.0 + tl.exp(-b)), 0.0)
    else:
        rows = (row0 + rc) * H + h
        k = tl.load(k_ptr + rows[:, None] * DK + rk[None, :], mask=valid[:, None] & mk[None, :], other=0.0)
        v = tl.load(v_ptr + rows[:, None] * DV + rv[None, :], mask=valid[:, None] & mv[None, :], other=0.0)
        g = tl.load(g_ptr + rows, mask=valid, other=0.0)
        beta = tl.load(beta_ptr + rows, mask=valid, other=0.0)
    cum = tl.cumsum(g, 0)  # log of the decay from the chunk's start through position i
    below = rc[:, None] >= rc[None, :]
    decay = tl.exp(tl.where(below, cum[:, None] - cum[None, :], float("-inf")))  # [C, C], 0 above the diagonal
    kb = k * beta[:, None]
    a = tl.dot(kb, tl.trans(k), input_precision=PREC) * decay
    a = tl.where(rc[:, None] > rc[None, :], a, 0.0)
    eye = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0)
    # (I + A)^-1 in blocks of 16: with D the block diagonal of I + A and E the rest (strictly block lower),
    # I + A = D (I + N), N = D^-1 E, N^4 = 0, so (I + A)^-1 = (I - N + N^2 - N^3) D^-1. D^-1 by forward
    # substitution, the four diagonal blocks at once: 15 rows in turn, not 63. (Doubling the block size instead,
    # X <- X - X E X from blocks of 1 to 64, matmuls only, took 7.0 ms against 4.0 ms for one layer of 8,192
    # tokens on an H200, perf/results/l2_prefetch_h200/inverse.txt, and was taken out.)
    same = (rc[:, None] // 16) == (rc[None, :] // 16)
    y = -tl.where(same, a, 0.0)
    for i in range(1, 16):  # rows i, 16 + i, 32 + i, 48 + i of D^-1 - I from the rows before them in their block
        ri = (rc % 16) == i
        row = tl.sum(tl.where(ri[:, None], y, 0.0), 0)  # the four rows, each in its own block's columns
        row = row + tl.sum(row[:, None] * y, 0)
        y = tl.where(ri[:, None] & same, row[None, :], y)
    d_inv = y + eye
    nn = tl.dot(d_inv, tl.where(same, 0.0, a), input_precision=PREC)
    n2 = tl.dot(nn, nn, input_precision=PREC)
    n3 = tl.dot(n2, nn, input_precision=PREC)
    x = tl.dot(eye - nn + n2 - n3, d_inv, input_precision=PREC)
    ecum = tl.exp(cum)
    last = tl.sum(tl.where(rc == C - 1, cum, 0.0), 0)  # padding has g = 0: the chunk's whole decay
    chunk = (h * M + m).to(tl.int64)
    ck = chunk * C * DK + rc[:, None] * DK + rk[None, :]
    cv = chunk * C * DV + rc[:, None] * DV + rv[None, :]
    tl.store(u_ptr + cv, tl.dot(x, v * beta[:, None], input_precision=PREC), mask=mv[None, :])
    tl.store(w_ptr + ck, tl.dot(x, kb * ecum[:, None], input_precision=PREC), mask=mk[None, :])
    tl.store(kd_ptr + ck, k * tl.exp(last - cum)[:, None], mask=mk[None, :])
    if RAW:
        q = tl.load(qrows, mask=valid[:, None] & mk[None, :], other=0.0)
        q = q * (tl.rsqrt(tl.sum(q * q, 1) + 1e-6) * q_scale)[:, None]
    else:
        q = tl.load(q_ptr + rows[:, None] * DK + rk[None, :], mask=valid[:, None] & mk[None, :], other=0.0)
    tl.store(qd_ptr + ck, q * ecum[:, None], mask=mk[None, :])
    attn = tl.dot(q, tl.trans(k), input_precision=PREC) * decay  # causal within the chunk, diagonal included
    tl.store(attn_ptr + chunk * C * C + rc[:, None] * C + rc[None, :], attn)
    tl.store(last_ptr + chunk, tl.exp(last))


@triton.jit
def _chunk_out_kernel(
    qd_ptr, attn_ptr, h_ptr, vn_ptr, o_ptr, row0_ptr, len_ptr, H, M,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """The parallel part, one program per (chunk m, head h, block of value dims): o = q_dec S_chunk + attn v_new,
    stored straight into the chunk's rows of o [T, H, DV]."""
    m, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row0 = tl.load(row0_ptr + m).to(tl.int64)
    n = tl.load(len_ptr + m)
    chunk = (h * M + m).to(tl.int64)
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    rc = tl.arange(0, C)
    mk, mv = rk < DK, rv < DV
    s = tl.load(h_ptr + chunk * DK * DV + rk[:, None] * DV + rv[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
    qd = tl.load(qd_ptr + chunk * C * DK + rc[:, None] * DK + rk[None, :], mask=mk[None, :], other=0.0)
    vn = tl.load(vn_ptr + chunk * C * DV + rc[:, None] * DV + rv[None, :], mask=mv[None, :], other=0.0)
    attn = tl.load(attn_ptr + chunk * C * C + rc[:, None] * C + rc[None, :])
    out = tl.dot(qd, s, input_precision=PREC) + tl.dot(attn, vn, input_precision=PREC)
    rows = (row0 + rc) * H + h
    tl.store(o_ptr + rows[:, None] * DV + rv[None, :], out, mask=(rc < n)[:, None] & mv[None, :])


# Launch settings of the chunked prefill (perf/kernels.py delta-rule --scan-sweep measures them). The matmuls
# take float32 operands in three TF32 passes ("tf32x3"): tensor cores, with about float32's accuracy. For models
# whose activations are 16-bit (chunked(low_precision=True)) one TF32 pass ("precision_16bit"): on an H200 one layer
# of 8,192 tokens took 2.50 ms against 4.02 ms (2.37 ms with the chunk algebra in 4 warps: "prep_warps_16bit"),
# 2.4e-4 from the PyTorch float32 form against 1e-7, far below the bf16 rounding of the layer's output
# (perf/results/l2_prefetch_h200/delta_precision.txt).
SCAN = {
    "bv": 32,
    "warps": 4,
    "out_bv": 64,
    "out_warps": 4,
    "prep_warps": 8,
    "precision": "tf32x3",
    "precision_16bit": "tf32",
    "prep_warps_16bit": 4,
}
_LAYOUTS: dict = {}  # (starts, lens, device) -> the chunk layout, built once per batch, not once per layer


def _chunk_layout(starts: list[int], lens: list[int], dev) -> tuple:
    """Each sequence's first chunk and chunk count, each chunk's first row and length, as device tensors."""
    key = (tuple(starts), tuple(lens), str(dev))
    hit = _LAYOUTS.get(key)
    if hit is None:
        counts = [triton.cdiv(n, CHUNK) for n in lens]
        firsts = [sum(counts[:i]) for i in range(len(counts))]
        row0 = [s0 + c * CHUNK for s0, cnt in zip(starts, counts) for c in range(cnt)]
        clen = [min(CHUNK, n - c * CHUNK) for n, cnt in zip(lens, counts) for c in range(cnt)]
        hit = tuple(torch.tensor(x, dtype=torch.int32, device=dev) for x in (firsts, counts, row0, clen))
        if len(_LAYOUTS) >= 8:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        _LAYOUTS[key] = hit
    return hit


def chunked(q, k, v, g, beta, state: torch.Tensor, pages, starts, lens, raw: tuple | None = None,
            out: torch.Tensor | None = None, low_precision: bool = False) -> torch.Tensor:  # fmt: skip
    """Sequences i = 0..N-1 own rows [starts[i], starts[i] + lens[i]) of q, k: [T, H, DK], v: [T, H, DV], g, beta:
    [T, H] (float32) and start from (and end in) state page pages[i] of state [pages, H, DK, DV]. pages: an int
    tensor [N] on the device; starts, lens: lists (or tensors) of ints. Returns o [T, H, DV] float32: `out` when
    given (contiguous; only the sequences' rows are written), else a new tensor (zero outside the sequences).

    raw = (mixed, b, a, a_log, dt_bias, num_key_heads) instead of q, k, v, g, beta (pass None for them): the conv
    output mixed [T, 2 Hk DK + H DV] float32 (rows of unit stride), the projection's b and a columns [T, H], read
    by the first launch, which computes the L2 norms and the gates itself (HybridModel._qkv_gates' work, without
    its [T, H, DK] copies); the state shape gives DK and DV.

    low_precision: the model's activations are 16-bit, so the matmuls may take SCAN["precision_16bit"] (one TF32
    pass) instead of SCAN["precision"] (float32 models); the state and every sum stay float32.

    Three launches, none of them with host work per chunk or per layer (the chunk layout is built once per batch):
    the state-independent chunk algebra of every chunk of every sequence in parallel; the state carried across
    each sequence's chunks (the only sequential work: two matmuls per chunk), storing the state each chunk starts
    from; every chunk's output in parallel, written to its rows."""
    if raw is None:
        T, H, DK = q.shape
        DV = v.shape[-1]
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        args = (q, k, v, g, beta)
        extra = (0, 0, q, q, 1.0)
        R = KD = 1
    else:
        mixed, b, a, a_log, dt_bias, hk = raw
        H, DK, DV = state.shape[1:]
        T = mixed.shape[0]
        assert mixed.stride(1) == 1 and mixed.dtype == torch.float32 and a.stride() == b.stride() and b.stride(1) == 1
        assert mixed.shape[1] == 2 * hk * DK + H * DV
        args = (mixed, mixed, mixed, a, b)
        extra = (mixed.stride(0), b.stride(0), a_log, dt_bias, DK**-0.5)
        R, KD = H // hk, hk * DK
    starts, lens = [int(x) for x in starts], [int(x) for x in lens]
    if out is None:  # rows outside the sequences read as zeros; none to clear when they cover every row
        packed = sum(lens) == T and starts == [sum(lens[:i]) for i in range(len(lens))]
        out = (torch.empty if packed else torch.zeros)((T, H, DV), dtype=torch.float32, device=state.device)
    assert out.shape == (T, H, DV) and out.dtype == torch.float32 and out.is_contiguous()
    if T == 0 or pages.numel() == 0:
        return out
    dev = state.device
    firsts, counts, row0, clen = _chunk_layout(starts, lens, dev)
    M = row0.numel()
    bk, bvp = max(16, triton.next_power_of_2(DK)), max(16, triton.next_power_of_2(DV))
    prec = SCAN["precision_16bit" if low_precision else "precision"] if dev.type == "cuda" else "ieee"
    u = torch.empty((H, M, CHUNK, DV), dtype=torch.float32, device=dev)
    v_new = torch.empty_like(u)
    w, qd, kd = (torch.empty((H, M, CHUNK, DK), dtype=torch.float32, device=dev) for _ in range(3))
    attn = torch.empty((H, M, CHUNK, CHUNK), dtype=torch.float32, device=dev)
    last = torch.empty((H, M), dtype=torch.float32, device=dev)
    _chunk_prep_kernel[(M, H)](
        *args, row0, clen, u, w, qd, kd, attn, last, H, M, *extra,
        DK=DK, DV=DV, BK=bk, BV=bvp, C=CHUNK, PREC=prec, RAW=raw is not None, R=R, KD=KD,
        num_warps=SCAN["prep_warps_16bit" if low_precision else "prep_warps"],
    )  # fmt: skip
    hs = torch.empty((H, M, DK, DV), dtype=torch.float32, device=dev)
    sp, sh, sk = _state_strides(state)
    bv = max(16, min(bvp, SCAN["bv"]))
    _chunk_state_kernel[(len(lens), H, triton.cdiv(DV, bv))](
        u, w, kd, last, hs, v_new, state, pages, firsts, counts, sp, sh, sk, M,
        DK=DK, DV=DV, BK=bk, BV=bv, C=CHUNK, PREC=prec, num_warps=SCAN["warps"], num_stages=1,
    )  # fmt: skip
    bv = max(16, min(bvp, SCAN["out_bv"]))
    _chunk_out_kernel[(M, H, triton.cdiv(DV, bv))](
        qd, attn, hs, v_new, out, row0, clen, H, M,
        DK=DK, DV=DV, BK=bk, BV=bv, C=CHUNK, PREC=prec, num_warps=SCAN["out_warps"],
    )  # fmt: skip
    return out


@triton.jit
def _conv_prefill_kernel(
    X, W, S, Out, n, C, stride_x,
    KM1: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """Depthwise causal conv over n new inputs of one sequence, then SiLU: X [n, >= C] (any dtype), W [C, KM1 + 1],
    S the sequence's conv state [C, KM1] (the KM1 inputs before X, oldest first), Out [n, C] float32."""
    pt, pc = tl.program_id(0), tl.program_id(1)
    rt = pt * BT + tl.arange(0, BT)
    rc = pc * BC + tl.arange(0, BC)
    mt, mc = rt < n, rc < C
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(KM1 + 1):  # tap j reads the input KM1 - j positions back
        src = rt - KM1 + j
        own = src >= 0
        xv = tl.load(X + src.to(tl.int64)[:, None] * stride_x + rc[None, :], mask=(own & mt)[:, None] & mc[None, :],
                     other=0.0).to(tl.float32)  # fmt: skip
        sv = tl.load(S + rc[None, :] * KM1 + (KM1 + src)[:, None], mask=(~own & mt)[:, None] & mc[None, :], other=0.0)
        w = tl.load(W + rc * (KM1 + 1) + j, mask=mc, other=0.0).to(tl.float32)
        acc += (xv + sv) * w[None, :]
    tl.store(
        Out + rt.to(tl.int64)[:, None] * C + rc[None, :], acc / (1.0 + tl.exp(-acc)), mask=mt[:, None] & mc[None, :]
    )


def conv_prefill(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, out=None) -> torch.Tensor:
    """backends.common.model.delta_rule.conv_prefill in one launch: x [n, >= C] (its first C columns, any dtype,
    computed in float32); conv_state [C, K - 1] float32 with unit strides inside (a page's view), updated in place;
    weight [C, K]. Returns float32 [n, C] (into out, contiguous rows of C, when given)."""
    n = x.shape[0]
    C, K = weight.shape
    km1 = K - 1
    assert conv_state.stride(1) == 1 and conv_state.stride(0) == km1 and x.stride(1) == 1
    if out is None:
        out = torch.empty((n, C), dtype=torch.float32, device=x.device)
    assert out.shape == (n, C) and out.is_contiguous() and out.dtype == torch.float32
    if n == 0:
        return out
    bt, bc = 32, 128
    _conv_prefill_kernel[(triton.cdiv(n, bt), triton.cdiv(C, bc))](
        x, weight, conv_state, out, n, C, x.stride(0), KM1=km1, BT=bt, BC=bc, num_warps=4
    )
    # the new state: the last K - 1 inputs (older ones from the state when n < K - 1), after the kernel read it
    if n >= km1:
        conv_state.copy_(x[n - km1 :, :C].t())
    else:
        conv_state.copy_(torch.cat((conv_state[:, n:], x[:, :C].t().float()), dim=1))
    return out


# ---- the decode step of a linear-attention layer, fused for CUDA graphs (backends.common.model.gpu_hybrid) ----------
@triton.jit
def _conv_step_kernel(
    X, W, S, Out, Pages, OutPages, stride_x, stride_o, s_page, C,
    KM1: tl.constexpr, BLOCK: tl.constexpr, PRELOAD: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Depthwise causal conv over one new input per sequence, then SiLU. X [B, >= C] (the projection's first C
    columns), W [C, KM1 + 1], S: conv state rows [pages, C, KM1] (page stride s_page), read at Pages[b] and the
    new state written at OutPages[b]; Out [B, C] float32. Every load comes before any store, so the loads are not
    ordered behind the stores. PRELOAD: the state rows, the weights and the pages are read before waiting for the
    launch before this one (the rows were written by an earlier launch than that: the caller's promise)."""
    b, cb = tl.program_id(0), tl.program_id(1)
    offs = cb * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    if PRELOAD:
        page = tl.load(Pages + b).to(tl.int64)
        out_page = tl.load(OutPages + b).to(tl.int64)
        prev, w = conv_load(offs, mask, W, S, page, s_page, KM1)
    enter(PDL)
    x = tl.load(X + b.to(tl.int64) * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if PRELOAD:
        y, full = conv_math(x, prev, w, KM1)
        conv_write(full, offs, mask, S, out_page, s_page, KM1)
    else:
        y = conv_channels(x, offs, mask, W, S, Pages + b, OutPages + b, s_page, KM1)
    tl.store(Out + b.to(tl.int64) * stride_o + offs, y, mask=mask)


@triton.jit
def conv_channels(x, offs, mask, W, S, Page, OutPage, s_page, KM1: tl.constexpr):
    """The conv step of channels offs (where mask) for one new input x (float32): SiLU of the causal conv over the
    state row at page *Page, whose new state (the kept inputs after the oldest, then x) goes to page *OutPage. Every
    load comes before any store."""
    page = tl.load(Page).to(tl.int64)
    out_page = tl.load(OutPage).to(tl.int64)
    y, full = _conv_read(x, offs, mask, W, S, page, s_page, KM1)
    conv_write(full, offs, mask, S, out_page, s_page, KM1)
    return y


@triton.jit
def conv_load(offs, mask, W, S, page, s_page, KM1: tl.constexpr):
    """The loads of `_conv_read` that need no new input: (the state rows of channels offs at page `page`
    [BLOCK, KM1 + 1], oldest first, then a 0; their conv weights, float32), for `conv_math` to use later (so a
    caller can issue them before what computes x)."""
    taps = tl.arange(0, KM1 + 1)  # KM1 + 1 is a power of two (the conv kernel: 4)
    prev = tl.load(S + page * s_page + offs[:, None] * KM1 + taps[None, :],
                   mask=mask[:, None] & (taps[None, :] < KM1), other=0.0)  # fmt: skip
    w = tl.load(W + offs[:, None] * (KM1 + 1) + taps[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
    return prev, w


@triton.jit
def conv_math(x, prev, w, KM1: tl.constexpr):
    """(SiLU of the causal conv [BLOCK], the kept inputs then x [BLOCK, KM1 + 1] for `conv_write`) of one new
    input x (float32) over `conv_load`'s state rows and weights."""
    taps = tl.arange(0, KM1 + 1)
    full = tl.where(taps[None, :] == KM1, x[:, None], prev)
    acc = tl.sum(full * w, 1)
    return acc / (1.0 + tl.exp(-acc)), full


@triton.jit
def _conv_read(x, offs, mask, W, S, page, s_page, KM1: tl.constexpr):
    """The loads and arithmetic of `conv_channels` at page `page`: (SiLU of the conv [BLOCK], the kept inputs then x
    [BLOCK, KM1 + 1] for `conv_write`, whose first column is not stored)."""
    prev, w = conv_load(offs, mask, W, S, page, s_page, KM1)
    return conv_math(x, prev, w, KM1)


@triton.jit
def conv_write(full, offs, mask, S, out_page, s_page, KM1: tl.constexpr):
    """The new conv state rows of channels offs (where mask), the last KM1 columns of `_conv_read`'s [BLOCK,
    KM1 + 1] (the oldest input dropped), stored at page `out_page`."""
    taps = tl.arange(0, KM1 + 1)
    tl.store(S + out_page * s_page + offs[:, None] * KM1 + taps[None, :] - 1, full,
             mask=mask[:, None] & (taps[None, :] >= 1))  # fmt: skip


@triton.jit
def conv_rows_load(offs_m, mask_m, offs_n, mask, W, S, Pages, OutPages, s_page, KM1: tl.constexpr):
    """`conv_load` for rows offs_m (where mask_m) over channels offs_n (where mask), row m on its own pages Pages[m]
    / OutPages[m]: (the state rows [BLOCK_M, BLOCK_N, KM1 + 1] at each row's page, oldest first, then a 0; the
    weights [1, BLOCK_N, KM1 + 1] float32; each row's page to write), for `conv_rows_finish` (kernels.linear's
    conv epilogue, which may issue them before what computes x)."""
    page = tl.load(Pages + offs_m, mask=mask_m, other=0).to(tl.int64)
    out_page = tl.load(OutPages + offs_m, mask=mask_m, other=0).to(tl.int64)
    taps = tl.arange(0, KM1 + 1)[None, None, :]
    m3 = (mask_m[:, None] & mask[None, :])[:, :, None]
    prev = tl.load(S + page[:, None, None] * s_page + offs_n[None, :, None] * KM1 + taps, mask=m3 & (taps < KM1),
                   other=0.0)  # fmt: skip
    w = tl.load(W + offs_n[None, :, None] * (KM1 + 1) + taps, mask=mask[None, :, None], other=0.0).to(tl.float32)
    return prev, w, out_page


@triton.jit
def conv_rows_finish(x, prev, w, out_page, offs_m, mask_m, offs_n, mask, S, s_page, KM1: tl.constexpr):
    """SiLU of the causal conv of new inputs x [BLOCK_M, BLOCK_N] (float32) over `conv_rows_load`'s state rows and
    weights; the new state rows (the kept inputs after the oldest, then x) stored at each row's out page."""
    taps = tl.arange(0, KM1 + 1)[None, None, :]
    m3 = (mask_m[:, None] & mask[None, :])[:, :, None]
    full = tl.where(taps == KM1, x[:, :, None], prev)
    acc = tl.sum(full * w, 2)
    tl.store(S + out_page[:, None, None] * s_page + offs_n[None, :, None] * KM1 + taps - 1, full,
             mask=m3 & (taps >= 1))  # fmt: skip
    return acc / (1.0 + tl.exp(-acc))


def conv_step(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    pages: torch.Tensor,
    out=None,
    out_pages=None,
    preload: bool = False,
):
    """x: [B, >= C] (its first C columns are the conv inputs, any dtype); weight [C, K] with K a power of two;
    conv_state [pages, C, K-1] float32, a view with unit stride inside a page, read at rows `pages` [B] and
    updated at rows `out_pages` (default: `pages`, in place). Returns float32 [B, C]. preload: the state rows are
    read before the wait for the launch just before (kernels.pdl), which therefore must not write them (x's
    projection does not; in a decode graph an earlier step did)."""
    B = x.shape[0]
    C, K = weight.shape
    assert conv_state.stride(2) == 1 and conv_state.stride(1) == K - 1 and x.stride(1) == 1 and K & (K - 1) == 0
    if out is None:
        out = torch.empty(B, C, dtype=torch.float32, device=x.device)
    if B == 0:
        return out
    block = 256
    _conv_step_kernel[(B, triton.cdiv(C, block))](
        x, weight, conv_state, out, pages, pages if out_pages is None else out_pages, x.stride(0), out.stride(0),
        conv_state.stride(0), C,
        KM1=K - 1, BLOCK=block, PRELOAD=preload, num_warps=4, **launch(x),
    )  # fmt: skip
    return out


@triton.jit
def _gated_delta_step_kernel(
    Mixed, Proj, ALog, DtBias, NormW, Out, S, Pages, OutPages, Part, Ctr, CW, CS, KCtr,
    stride_m, stride_p, stride_out, s_page, s_head, s_k, z_off, b_off, a_off, eps, q_scale, cs_page,
    HV: tl.constexpr, R: tl.constexpr, KD: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, PRELOAD: tl.constexpr, AHEAD: tl.constexpr,
    SPLIT: tl.constexpr, CONV: tl.constexpr, KM1: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, value head): the head's [DK, DV] state in NV blocks of BV value dims, each
    loaded from page Pages[b], updated, stored to page OutPages[b] and read out in turn; then the gated RMSNorm over
    all DV outputs (from registers with one block, else read back). PRELOAD: the first block's state is loaded
    before waiting for the launch before this one (the page was written by an earlier step, never by the launch
    just before: the caller's promise). AHEAD (NV > 1): the second block is loaded with the first, before the
    first block's store (which the compiler cannot tell apart from the page read), so both reads are in flight at
    once. SPLIT > 1: SPLIT programs per head (program_id 2), each with NV blocks of its own; each stores its raw
    outputs and their sum of squares (Part), and the last of a head's programs to finish (counted in Ctr, which it
    resets to 0 for the next launch) adds the sums in split order and applies the norm to the whole head.
    CONV: the conv step too (`conv_channels`, on conv state CS at the same pages, weights CW), from the projection's
    own first columns in Proj instead of Mixed: each program convolves its q and k channels and its value dims' v
    channels; the v channels' new state is its own to store, while the q and k channels' is stored by the last
    of the R * SPLIT programs that read them to arrive (counted in KCtr, one counter per sequence and key head,
    reset to 0 by that program), so no program reads a state row another has already moved on."""
    b, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    c0 = tl.program_id(2) * (NV * BV)  # this program's first value dim
    rk = tl.arange(0, BK)
    mk = rk < DK
    rv0 = c0 + tl.arange(0, BV)
    if PRELOAD:
        page = tl.load(Pages + b).to(tl.int64)  # the graph's inputs: copied in before any launch of the step
        s0 = _state_block(S, page * s_page + h * s_head, rk, rv0, mk, s_k, DV)
        if AHEAD:
            s1 = _state_block(S, page * s_page + h * s_head, rk, BV + rv0, mk, s_k, DV)
    enter(PDL)
    if not PRELOAD:
        page = tl.load(Pages + b).to(tl.int64)
        if AHEAD:
            s0 = _state_block(S, page * s_page + h * s_head, rk, rv0, mk, s_k, DV)
            s1 = _state_block(S, page * s_page + h * s_head, rk, BV + rv0, mk, s_k, DV)
    out_page = tl.load(OutPages + b).to(tl.int64)
    kh = h // R  # the key head this value head reads (q and k repeat_interleave'd by R)
    mrow = Mixed + b * stride_m
    prow = Proj + b * stride_p
    if CONV:  # q and k through the conv here; their new state stored by the last of the programs reading them
        qc = kh * DK + rk
        q, nq = _conv_read(tl.load(prow + qc, mask=mk, other=0.0).to(tl.float32), qc, mk, CW, CS, page, cs_page,
                           KM1)  # fmt: skip
        k, nk = _conv_read(tl.load(prow + KD + qc, mask=mk, other=0.0).to(tl.float32), KD + qc, mk, CW, CS, page,
                           cs_page, KM1)  # fmt: skip
        key = b * (HV // R) + kh
        tl.debug_barrier()  # every thread's reads of the q and k state rows done before the arrival
        if tl.atomic_add(KCtr + key, 1, sem="acq_rel") == R * SPLIT - 1:
            conv_write(nq, qc, mk, CS, out_page, cs_page, KM1)
            conv_write(nk, KD + qc, mk, CS, out_page, cs_page, KM1)
            tl.atomic_xchg(KCtr + key, 0)
    else:
        q = tl.load(mrow + kh * DK + rk, mask=mk, other=0.0)
        k = tl.load(mrow + KD + kh * DK + rk, mask=mk, other=0.0)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * q_scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    beta = tl.sigmoid(tl.load(prow + b_off + h).to(tl.float32))
    a = tl.load(prow + a_off + h).to(tl.float32) + tl.load(DtBias + h).to(tl.float32)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
    decay = tl.exp(-tl.exp(tl.load(ALog + h).to(tl.float32)) * softplus)
    dt = Out.dtype.element_ty
    orow = Out + b * stride_out + h * DV
    zrow = prow + z_off + h * DV
    sumsq = 0.0
    for vb in tl.static_range(NV):
        rv = c0 + vb * BV + tl.arange(0, BV)
        mv = rv < DV
        if CONV:  # this program's own channels: read, then stored
            vc = 2 * KD + h * DV + rv
            v, nv = _conv_read(tl.load(prow + vc, mask=mv, other=0.0).to(tl.float32), vc, mv, CW, CS, page, cs_page,
                               KM1)  # fmt: skip
            conv_write(nv, vc, mv, CS, out_page, cs_page, KM1)
        else:
            v = tl.load(mrow + 2 * KD + h * DV + rv, mask=mv, other=0.0)
        tile = h * s_head + rk[:, None] * s_k + rv[None, :]
        m2 = mk[:, None] & mv[None, :]
        if (PRELOAD or AHEAD) and vb == 0:
            s = s0 * decay
        elif AHEAD and vb == 1:
            s = s1 * decay
        else:
            s = tl.load(S + page * s_page + tile, mask=m2, other=0.0) * decay
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        tl.store(S + out_page * s_page + tile, s, mask=m2)
        o = tl.sum(s * q[:, None], axis=0).to(dt)  # the core output, rounded as the PyTorch model rounds it
        if NV > 1 or SPLIT > 1:  # read back by the norm below
            tl.store(orow + rv, o, mask=mv)
        of = o.to(tl.float32)
        sumsq += tl.sum(tl.where(mv, of * of, 0.0), 0)
    if SPLIT > 1:
        head = b * HV + h
        tl.store(Part + head * SPLIT + tl.program_id(2), sumsq)
        tl.debug_barrier()  # every thread's raw outputs stored before the arrival releases them
        done = tl.atomic_add(Ctr + head, 1, sem="acq_rel")  # releases this program's outputs, acquires the others'
        if done == SPLIT - 1:
            total = 0.0
            for sp in tl.static_range(SPLIT):
                total += tl.load(Part + head * SPLIT + sp, cache_modifier=".cg")
            rstd = tl.rsqrt(total / DV + eps)
            _gated_norm_read_back(orow, zrow, NormW, rstd, dt, DV, BV, NV * SPLIT, ".cg")  # others' outputs: L2
            tl.atomic_xchg(Ctr + head, 0)
    else:
        rstd = tl.rsqrt(sumsq / DV + eps)
        if NV == 1:  # the whole head in this program's registers
            _gated_norm(o, orow + rv, tl.load(NormW + rv, mask=mv, other=0.0), zrow + rv, mv, rstd, dt)
        else:
            tl.debug_barrier()  # the raw outputs this program stored are visible to all of its threads
            _gated_norm_read_back(orow, zrow, NormW, rstd, dt, DV, BV, NV, "")


@triton.jit
def _gated_norm_read_back(orow, zrow, NormW, rstd, dt, DV, BV: tl.constexpr, NB: tl.constexpr,
                          CACHE: tl.constexpr):  # fmt: skip
    """`_gated_norm` of a head's raw outputs stored at orow, in NB blocks of BV, read with `CACHE` as the
    cache modifier ("": the default; ".cg": past L1, for outputs other programs stored)."""
    for vb in tl.static_range(NB):
        rv = vb * BV + tl.arange(0, BV)
        mv = rv < DV
        o = tl.load(orow + rv, mask=mv, other=0.0, cache_modifier=CACHE)
        _gated_norm(o, orow + rv, tl.load(NormW + rv, mask=mv, other=0.0), zrow + rv, mv, rstd, dt)


@triton.jit
def _state_block(S, base, rk, rv, mk, s_k, DV):
    """A [BK, BV] block of one head's float32 state: rows rk, value dims rv (masked past DK and DV)."""
    return tl.load(S + base + rk[:, None] * s_k + rv[None, :], mask=mk[:, None] & (rv < DV)[None, :], other=0.0)


@triton.jit
def _gated_norm(o, optrs, w, zptrs, mask, rstd, dt):
    """The gated RMSNorm of raw outputs o, given their head's rstd (broadcast to o): (o * rstd, rounded) * w,
    times silu(z read at zptrs), stored at optrs."""
    y = (o.to(tl.float32) * rstd).to(dt)
    y = (w * y).to(tl.float32)
    z = tl.load(zptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(optrs, (y * (z / (1.0 + tl.exp(-z)))).to(dt), mask=mask)


@triton.jit
def _gated_norm_rows_kernel(Core, Z, NormW, Out, stride_c, stride_z, stride_o, eps, HV: tl.constexpr,
                            DV: tl.constexpr, BH: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """One program per row, every value head at once ([BH, BV] tiles): the raw outputs rounded to Out's dtype,
    each head's rstd, then `_gated_norm`."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    rh = tl.arange(0, BH)
    rv = tl.arange(0, BV)
    mv = rv < DV
    m2 = (rh < HV)[:, None] & mv[None, :]
    cols = rh[:, None] * DV + rv[None, :]
    dt = Out.dtype.element_ty
    o = tl.load(Core + t * stride_c + cols, mask=m2, other=0.0).to(dt)
    of = o.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(of * of, 1) / DV + eps)
    w = tl.load(NormW + rv, mask=mv, other=0.0)
    _gated_norm(o, Out + t * stride_o + cols, w[None, :], Z + t * stride_z + cols, m2, rstd[:, None], dt)


def gated_norm_rows(core: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, eps: float, dtype) -> torch.Tensor:
    """hybrid_model.gated_rms_norm(core.to(dtype), z, norm_w, eps) in one launch (the prefill's linear-attention
    output; the decode step does it in `gated_delta_step`): core [T, HV, DV] any float dtype, z [T, HV, DV] (unit
    stride inside a row's heads). Returns [T, HV * DV] in dtype."""
    T, HV, DV = core.shape
    core = core.reshape(T, HV * DV)
    z = z.reshape(T, HV * DV)
    assert core.stride(1) == 1 and z.stride(1) == 1
    out = torch.empty(T, HV * DV, dtype=dtype, device=core.device)
    if T:
        _gated_norm_rows_kernel[(T,)](
            core, z, norm_w, out, core.stride(0), z.stride(0), out.stride(0), eps, HV=HV, DV=DV,
            BH=triton.next_power_of_2(HV), BV=triton.next_power_of_2(DV), num_warps=4 if HV * DV <= 2048 else 8,
            **launch(core),
        )  # fmt: skip
    return out


def step_settings(batch: int, preload: bool = False) -> dict:
    """`gated_delta_step`'s keyword settings for a batch: whole 128-dim heads for a few sequences, 64 from 16 up
    (perf/kernels.py hybrid-steps on an H200, Qwen3-Next's shapes: 146 against 150 µs at batch 128, 41 against 42 at 32,
    4.8 against 5.2 at 1), with preload as given: the state read before the programmatic-dependent-launch wait
    (the caller's promise that the launch before wrote no page read here; 3.7 against 4.3 µs at batch 1 on an H200,
    perf/results/preload_h200/)."""
    return dict(block_v=128 if batch < 16 else 64, preload=preload)


def gated_delta_step(
    mixed: torch.Tensor, proj: torch.Tensor, a_log, dt_bias, norm_w, state: torch.Tensor, pages: torch.Tensor,
    num_key_heads: int, eps: float, out: torch.Tensor | None = None, block_v: int = 64, num_warps: int = 4,
    out_pages: torch.Tensor | None = None, preload: bool = False, ahead: bool = False, split: int = 1,
    counters: torch.Tensor | None = None, conv: tuple | None = None,
) -> torch.Tensor:  # fmt: skip
    """The rest of a linear-attention layer's decode step after the conv, in one launch: L2 norms of q and k
    (q scaled by DK^-1/2), the gates beta = sigmoid(b) and g = -exp(A_log) softplus(a + dt_bias), the delta-rule
    update of the state page (read at `pages`, written at `out_pages`, default in place), the read-out and the
    gated RMSNorm with z.

    mixed: [B, 2 * Hk * DK + HV * DV] float32 (conv output: q, k, v of every head); proj: [B, >= a_off + HV] (the
    projection, columns [z (HV * DV) | b (HV) | a (HV)] from z_off = mixed's width); state [pages, HV, DK, DV]
    float32. block_v: value dims per block of the state tile (a [DK, block_v] float32 tile in registers). preload:
    the state is read before waiting for the launch before (programmatic dependent launch); only where that launch
    did not write the state pages read here. ahead: with more than one block, the second block's state is read
    with the first (two reads in flight per program, twice the registers). split: programs per head, each with
    an equal share of the blocks (more programs at a small batch; the last of a head's programs applies the norm,
    which needs `counters`: at least B * HV int32 zeros, left at zero, that no other launch uses at the same time).
    conv (weight [C, K], conv_state [pages, C, K-1] as for `conv_step`, C = mixed's width): the conv step in this
    launch, read from proj's first C columns and its state updated at the same pages; mixed is then not read (may
    be None), and `counters` needs B * (HV + num_key_heads) entries (the key heads' after B * HV).
    Returns [B, HV * DV] in proj's dtype."""
    B = proj.shape[0]
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
    blocks = triton.cdiv(DV, bv)
    if split > 1:
        if blocks % split or counters is None or counters.numel() < B * HV:
            raise ValueError(f"split {split}: needs {blocks} blocks of {bv} in equal shares and B * HV counters")
        part = torch.empty(B * HV * split, dtype=torch.float32, device=state.device)
    else:
        part = out  # not read
    km1, cs_page = 1, 0
    if conv is not None:
        cw, cs = conv
        C, K = cw.shape
        if C != z_off or cs.shape[1:] != (C, K - 1) or cs.stride(2) != 1 or cs.stride(1) != K - 1 or K & (K - 1):
            raise ValueError(f"conv: weight {tuple(cw.shape)} and state {tuple(cs.shape)} for {z_off} channels")
        if counters is None or counters.numel() < B * (HV + num_key_heads):
            raise ValueError("conv: needs B * (HV + num_key_heads) counters")
        km1, cs_page, kctr = K - 1, cs.stride(0), counters[B * HV :]
        mixed = proj  # not read
    else:
        cw = cs = kctr = out  # not read
    if counters is None:
        counters = out  # not read
    _gated_delta_step_kernel[(B, HV, split)](
        mixed, proj, a_log, dt_bias, norm_w, out, state, pages, pages if out_pages is None else out_pages, part,
        counters, cw, cs, kctr,
        mixed.stride(0), proj.stride(0), out.stride(0), sp, sh, sk, z_off, z_off + HV * DV, z_off + HV * DV + HV, eps,
        DK**-0.5, cs_page, HV=HV, R=HV // num_key_heads, KD=KD, DK=DK, DV=DV, BK=bk, BV=bv, NV=blocks // split,
        PRELOAD=preload, AHEAD=ahead and blocks // split > 1, SPLIT=split, CONV=conv is not None, KM1=km1,
        num_warps=num_warps, **launch(proj),
    )  # fmt: skip
    return out
