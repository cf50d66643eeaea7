"""Batch-invariant kernels for `--deterministic` (issue #29): a row's result has the same bits whatever else is in
the batch, and the K/V that a prefill (whole or in chunks) writes for a position are the bits decode writes for it.

The rule every kernel here follows: **a row's reduction order is fixed by the data's own shape (K, the context
length), never by the number of rows, the chunking or the launch grid.**

- `linear(x, w)`: x @ w.T (+ bias): each output is one float32 tensor-core accumulation chain over K in steps of
  BLOCK_K columns, in order, never split across programs. Only the tile around it changes with the number of rows
  (narrow column tiles for decode's few rows; for prefill a persistent kernel with TMA tile loads), which the
  H200 was checked not to change (tests/kernels/test_invariant.py compares the tile settings bitwise).
- `decode_attention` / `prefill_attention`: the keys of a query are cut into segments of `SEG_KV` positions
  counted from position 0. Each segment is reduced from a fresh online softmax in blocks of BLOCK_N keys, giving
  (out, log-sum-exp); every sum over keys (scores, the softmax's row sums, p @ V) runs on the tensor cores, so
  prefill's 64-query tiles and decode's 16-row tiles (a GQA group) give the same bits. Segments are merged in order
  with one elementwise formula: prefill, and decode with one program per (sequence, kv head), merge them in
  registers as they end; decode with several programs stores them and the last to finish merges them. A segment
  or block that holds none of a row's keys leaves the result unchanged, bit for bit.

Everything else on the deterministic path is already per row: the Triton RMSNorm (one program per row, its
reduction shaped by the hidden size), rope, SiLU-mul, embedding, argmax."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import sm_count
from kernels.pdl import enter, launch

SEG_KV = 256  # key positions per attention segment
BLOCK_K = 64
_LOG2E = 1.4426950408889634


# ---- linear ---------------------------------------------------------------------------------------------------
@triton.jit
def _tile(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    """Program index -> (row tile, column tile), GROUP row tiles side by side per column sweep (L2 reuse)."""
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP * tiles_n
    first_m = (tile // per_group) * GROUP
    size_m = tl.minimum(tiles_m - first_m, GROUP)
    return first_m + (tile % per_group) % size_m, (tile % per_group) // size_m


@triton.jit
def _linear_kernel(
    X, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program -> (row tile, column tile) by `_tile`; x[rm] @ w[rn].T summed from zero in steps of BK columns in
    order (float32, one tensor-core accumulation chain per output), + bias, rounded once."""
    pm, pn = _tile(tl.program_id(0), M, N, BM, BN, GROUP)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    mask_m, mask_n = rm < M, rn < N
    x_ptr = X + rm.to(tl.int64)[:, None] * stride_xm + tl.arange(0, BK)[None, :]
    w_ptr = W + rn.to(tl.int64)[:, None] * stride_wn + tl.arange(0, BK)[None, :]
    enter(PDL)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            x = tl.load(x_ptr + k0, mask=mask_m[:, None], other=0.0)
            w = tl.load(w_ptr + k0, mask=mask_n[:, None], other=0.0)
        else:
            mk = (k0 + tl.arange(0, BK)) < K
            x = tl.load(x_ptr + k0, mask=mask_m[:, None] & mk[None, :], other=0.0)
            w = tl.load(w_ptr + k0, mask=mask_n[:, None] & mk[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


@triton.jit
def _linear_tma_kernel(
    x_desc, w_desc, y_desc, Bias, M, N, K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """`_linear_kernel` for many rows, persistent (PROGRAMS programs walk the tiles) with TMA tile loads; the same
    accumulation chain per output (tiles past K are zeros, as the masked loads give)."""
    k_tiles = tl.cdiv(K, BK)
    enter(PDL)
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BM) * tl.cdiv(N, BN), PROGRAMS, flatten=FLATTEN):
        pm, pn = _tile(tile, M, N, BM, BN, GROUP)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for ki in range(k_tiles):
            x = x_desc.load([pm * BM, ki * BK])
            w = w_desc.load([pn * BN, ki * BK])
            acc = tl.dot(x, w.T, acc)
        if HAS_BIAS:
            rn = pn * BN + tl.arange(0, BN)
            acc += tl.load(Bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        y_desc.store([pm * BM, pn * BN], acc.to(y_desc.dtype))


# launch settings by row count: rows and columns per tile, warps, stages, and columns per step (bk, default
# BLOCK_K). Every one runs the same chain of tensor-core steps of 16 columns, in order, on each output, so a row's
# bits do not depend on which one a batch gets (tests/kernels/test_invariant.py checks TILES against each other on
# the H200; perf/kernels.py invariant found no difference among 22-40 settings on Llama-3.1-8B's projections).
# Defaults from that sweep (graph-timed, H200: within 0.94-1.10x cuBLAS up to 32 rows; at 8,192 rows the persistent
# TMA kernel, 0.97-1.04x cuBLAS, where the plain loop took 1.31-1.35x).
SETTINGS = [
    (64, dict(bm=64, bn=64, bk=128, warps=4, stages=4)),
    (256, dict(bm=64, bn=128, bk=128, warps=4, stages=4)),
    (1 << 62, dict(tma=True, bm=128, bn=256, bk=64, warps=8, stages=3, flatten=True)),
]
# what `tune` times for a decode graph's projections (the best differed by projection in the sweep)
CANDIDATES = {
    "few": [dict(bm=64, bn=64, bk=128, warps=4, stages=4), dict(bm=64, bn=32, bk=256, warps=4, stages=4),
            dict(bm=64, bn=128, bk=128, warps=4, stages=4), dict(bm=64, bn=64, bk=64, warps=4, stages=3),
            dict(bm=16, bn=64, bk=256, warps=4, stages=4), dict(bm=16, bn=128, bk=128, warps=4, stages=5)],
    "many": [dict(bm=64, bn=128, bk=128, warps=4, stages=4), dict(bm=64, bn=64, bk=256, warps=4, stages=3),
             dict(bm=128, bn=128, bk=64, warps=8, stages=3)],
}  # fmt: skip
TILES = [st for _, st in SETTINGS] + [
    dict(bm=64, bn=16, warps=4, stages=4), dict(bm=64, bn=32, bk=256, warps=4, stages=3),
    dict(bm=16, bn=64, bk=256, warps=4, stages=4),
    dict(bm=128, bn=256, warps=8, stages=3), dict(bm=128, bn=128, bk=128, warps=8, stages=3),
    dict(tma=True, bm=128, bn=128, warps=8, stages=3), dict(tma=True, bm=128, bn=256, warps=8, stages=3, flatten=True),
]  # fmt: skip


def settings_for(m: int) -> dict:
    return next(st for rows, st in SETTINGS if m <= rows)


def tune(weights: list[torch.Tensor], rows: int) -> tuple[dict, dict]:
    """The fastest of CANDIDATES for `rows` rows times each of `weights` (one projection of every layer), timed as
    a CUDA graph as kernels.linear.tune times. Any choice gives the same bits, so processes may choose
    differently. Returns (settings, {description: seconds per weight or an error})."""
    from kernels.linear import fastest

    N, K = weights[0].shape
    x = torch.randn(rows, K, device=weights[0].device, dtype=weights[0].dtype)
    out = torch.empty(rows, N, device=x.device, dtype=x.dtype)
    run = lambda st: [linear(x, w, out=out, settings=st) for w in weights]  # noqa: E731
    return fastest(CANDIDATES["few" if rows <= 64 else "many"], run, len(weights), settings_for(rows))


def _tma_ok(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned bases and row strides, unit stride along the row."""
    return all(t.stride(1) == 1 and t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
               for t in (x, w, out))  # fmt: skip


def _linear_tma(x, w, bias, out, st, bk) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = x.shape
    N = w.shape[0]
    bm, bn = st["bm"], st["bn"]
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    programs = min(tiles, sm_count(x.device, cpu=4))  # the interpreter: a few programs, each walking several tiles
    _linear_tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]), bias if bias is not None else w, M, N, K,
        BM=bm, BN=bn, BK=bk, GROUP=st.get("group", 8), PROGRAMS=programs, FLATTEN=st.get("flatten", False),
        HAS_BIAS=bias is not None, num_warps=st["warps"], num_stages=st["stages"], **launch(x),
    )  # fmt: skip
    return out


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
           settings: dict | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ w [N, K].T (+ bias [N]), each output summed over K in one fixed order (see the module docstring).
    settings: tile settings (default `settings_for(M)`; any of TILES gives the same bits)."""
    M, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K and x.stride(1) == 1 and w.stride(1) == 1, (x.shape, w.shape)
    if out is None:
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    st = settings or settings_for(M)
    bk = st.get("bk", BLOCK_K)
    if st.get("tma") and _tma_ok(x, w, out):
        return _linear_tma(x, w, bias, out, st, bk)
    _linear_kernel[(triton.cdiv(M, st["bm"]) * triton.cdiv(N, st["bn"]),)](
        x, w, bias if bias is not None else w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
        BM=st["bm"], BN=st["bn"], BK=bk, GROUP=st.get("group", 8), EVEN_K=K % bk == 0, HAS_BIAS=bias is not None,
        num_warps=st["warps"], num_stages=st["stages"], **launch(x),
    )  # fmt: skip
    return out


# ---- attention ----------------------------------------------------------------------------------------------
@triton.jit
def _block_step(q, K, V, Table, row, kvh, limit, n0, ctx, stride_ks, stride_kh, stride_vs, stride_vh, stride_tr,
                scale_log2, m, l_sum, acc, D: tl.constexpr, BLOCK_N: tl.constexpr, SEG: tl.constexpr):  # fmt: skip
    """One block of BLOCK_N keys from n0 folded into its segment's online softmax (m, l_sum, acc) for a [BM, D]
    query tile, which starts afresh at the segment's first block: a query row keeps key n when n < limit[row]; keys
    at or past ctx are not loaded."""
    fresh = n0 % SEG == 0
    m = tl.where(fresh, float("-inf"), m)
    l_sum = tl.where(fresh, 0.0, l_sum)
    acc = tl.where(fresh, 0.0, acc)
    offs_d = tl.arange(0, D)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < ctx
    slots = tl.load(Table + row * stride_tr + offs_n, mask=mask_n, other=0).to(tl.int64)
    k = tl.load(K + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale_log2
    s = tl.where(offs_n[None, :] < limit[:, None], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row without keys yet: p = 0, alpha = 0
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    v = tl.load(V + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    pv = p.to(v.dtype)
    # the row sums through the tensor cores too (p @ ones: only column 0 kept, an exact pick): tl.sum's order
    # follows the tile's register layout, which differs between 16- and 64-row tiles
    ones = tl.where(tl.arange(0, 16)[None, :] == 0, 1.0, 0.0).to(v.dtype) + tl.zeros([BLOCK_N, 16], v.dtype)
    rows = tl.dot(pv, ones)
    l_sum = l_sum * alpha + tl.sum(tl.where(tl.arange(0, 16)[None, :] == 0, rows, 0.0), 1)
    acc = acc * alpha[:, None] + tl.dot(pv, v)
    return m_new, l_sum, acc


@triton.jit
def _finish(m, l_sum, acc):
    """A segment's online softmax -> (out [BM, D] float32, log2-sum-exp [BM], -inf for a row without keys)."""
    has = l_sum > 0
    out = acc / tl.where(has, l_sum, 1.0)[:, None]
    lse = tl.where(has, m + tl.log2(tl.where(has, l_sum, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def _merge(out_a, lse_a, out_b, lse_b):
    """Two softmax partials merged (elementwise, the same bits wherever it runs); a partial with lse -inf leaves the
    other unchanged."""
    m = tl.maximum(lse_a, lse_b)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp2(lse_a - m_use)
    wb = tl.exp2(lse_b - m_use)
    tot = wa + wb
    has = tot > 0
    out = (out_a * wa[:, None] + out_b * wb[:, None]) / tl.where(has, tot, 1.0)[:, None]
    lse = tl.where(has, m_use + tl.log2(tl.where(has, tot, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def _prefill_kernel(
    Q, K, V, O, Table, Rows, QStart, QLen, CtxLen,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_tr, scale_log2,
    GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr, SEG: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Program (sequence, block of BM queries, head): the queries' segments merged in order, in registers."""
    i, mb, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    enter(PDL)
    q_len = tl.load(QLen + i)
    if mb * BM >= q_len:
        return
    q_start = tl.load(QStart + i).to(tl.int64)
    ctx = tl.load(CtxLen + i)
    row = tl.load(Rows + i).to(tl.int64)
    kvh = h // GROUP
    prefix = ctx - q_len
    offs_m = mb * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    mask_m = offs_m < q_len
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=mask_m[:, None],
                other=0.0)  # fmt: skip
    limit = prefix + offs_m + 1  # query at position p sees keys 0..p
    end = tl.minimum(ctx, prefix + (mb + 1) * BM)
    out = tl.zeros([BM, D], dtype=tl.float32)
    lse = tl.full([BM], float("-inf"), dtype=tl.float32)
    m = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    # one flat loop over the key blocks (the software pipeline runs across segment borders); a segment starts from
    # a fresh softmax and, at its last block, is merged into (out, lse) in order
    for n0 in range(0, end, BLOCK_N):
        m, l_sum, acc = _block_step(q, K, V, Table, row, kvh, limit, n0, ctx, stride_ks, stride_kh, stride_vs,
                                    stride_vh, stride_tr, scale_log2, m, l_sum, acc, D, BLOCK_N, SEG)  # fmt: skip
        if ((n0 + BLOCK_N) % SEG == 0) | (n0 + BLOCK_N >= end):
            o_s, l_s = _finish(m, l_sum, acc)
            out, lse = _merge(out, lse, o_s, l_s)
    tl.store(O + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=mask_m[:, None])  # fmt: skip


@triton.jit
def _decode_kernel(
    Q, K, V, O, Table, Rows, SeqLens, QIdx, MidO, MidL, Counter,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_tr,
    stride_mb, stride_mh, stride_ms, scale_log2,
    GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr, SEG: tl.constexpr,
    ONE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (sequence, kv head, p): the query's heads of that kv head as rows of a BM-row tile; the p-th run of
    ceil(segments / programs) segments, each stored as (out, lse); the last program to finish merges all in
    segment order. ONE (one program per (sequence, kv head)): the segments merged in registers as they end, in the
    same order with the same formula (prefill's way), with no partials in memory."""
    b, kvh, p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    np_ = tl.num_programs(2)
    enter(PDL)
    ctx = tl.load(SeqLens + b)
    row = tl.load(Rows + b).to(tl.int64)
    qrow = tl.load(QIdx + b).to(tl.int64)
    offs_g = tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    mask_g = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q = tl.load(Q + qrow * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_g[:, None], other=0.0)
    limit = tl.zeros([BM], dtype=tl.int32) + ctx
    nseg = tl.cdiv(ctx, SEG)
    mid_o = MidO + b.to(tl.int64) * stride_mb + heads[:, None] * stride_mh + offs_d[None, :]
    mid_l = MidL + b.to(tl.int64) * (stride_mb // D) + heads * (stride_mh // D)
    # this program's segments: a contiguous run, in one flat loop over their key blocks (the software pipeline runs
    # across segment borders); each segment from a fresh softmax, stored at its last block
    per = tl.cdiv(nseg, np_)
    lo = p * per * SEG
    hi = tl.minimum((p + 1) * per * SEG, ctx)
    m = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    out = tl.zeros([BM, D], dtype=tl.float32)
    lse = tl.full([BM], float("-inf"), dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        m, l_sum, acc = _block_step(q, K, V, Table, row, kvh, limit, n0, ctx, stride_ks, stride_kh, stride_vs,
                                    stride_vh, stride_tr, scale_log2, m, l_sum, acc, D, BLOCK_N, SEG)  # fmt: skip
        if ((n0 + BLOCK_N) % SEG == 0) | (n0 + BLOCK_N >= hi):
            o_s, l_s = _finish(m, l_sum, acc)
            if ONE:
                out, lse = _merge(out, lse, o_s, l_s)
            else:
                s = n0 // SEG
                tl.store(mid_o + s * stride_ms, o_s, mask=mask_g[:, None])
                tl.store(mid_l + s * (stride_ms // D), l_s, mask=mask_g)
    if ONE:
        tl.store(O + qrow * stride_ot + heads[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=mask_g[:, None])  # fmt: skip
        return
    tl.debug_barrier()
    done = tl.atomic_add(Counter + b * tl.num_programs(1) + kvh, 1, sem="acq_rel")
    if done == np_ - 1:
        out = tl.zeros([BM, D], dtype=tl.float32)
        lse = tl.full([BM], float("-inf"), dtype=tl.float32)
        for s in range(0, nseg):
            o_s = tl.load(mid_o + s * stride_ms, mask=mask_g[:, None], other=0.0, cache_modifier=".cg")
            l_s = tl.load(mid_l + s * (stride_ms // D), mask=mask_g, other=float("-inf"), cache_modifier=".cg")
            out, lse = _merge(out, lse, o_s, l_s)
        tl.store(O + qrow * stride_ot + heads[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=mask_g[:, None])  # fmt: skip
        tl.store(Counter + b * tl.num_programs(1) + kvh, 0)


# query rows per tile: prefill's 64 queries; decode's GQA group padded to decode_bm rows (16: a quarter of the
# tensor-core work of 64 for the same bits, since a tensor-core dot rounds a row the same in a tile of any height)
ATTN = dict(
    bm=64,
    decode_bm=16,
    block_n=64,
    warps=4,
    stages=3,
    decode_warps=4,
    decode_stages=3,
)


def _block_n(D: int) -> int:
    return ATTN["block_n"] if D <= 128 else 32


def prefill_attention(q, k_pool, v_pool, table, rows, q_start, q_len, ctx_len, max_q_len: int, scale: float,
                      out: torch.Tensor | None = None, settings: dict | None = None) -> torch.Tensor:  # fmt: skip
    """As kernels.attention.prefill_attention (same arguments), with the segment order of the module docstring.
    settings: bm/warps/stages overriding ATTN's (launch shape only: the bits do not change)."""
    st = {**ATTN, **(settings or {})}
    N = rows.shape[0]
    _, H, D = q.shape
    group = H // k_pool.shape[1]
    if out is None:
        out = torch.empty_like(q)
    if N == 0:
        return out
    grid = (N, triton.cdiv(max_q_len, st["bm"]), H)
    _prefill_kernel[grid](
        q, k_pool, v_pool, out, table, rows, q_start, q_len, ctx_len,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        out.stride(0), out.stride(1), table.stride(0), scale * _LOG2E,
        GROUP=group, D=D, BM=st["bm"], BLOCK_N=_block_n(D), SEG=SEG_KV, num_warps=st["warps"],
        num_stages=st["stages"], **launch(q),
    )  # fmt: skip
    return out


def decode_attention(q, k_pool, v_pool, table, rows, seq_lens, scale: float, max_ctx: int,
                     out: torch.Tensor | None = None, q_idx: torch.Tensor | None = None,
                     counters: torch.Tensor | None = None, programs: int | None = None,
                     settings: dict | None = None) -> torch.Tensor:  # fmt: skip
    """One query per sequence (rows q_idx[b] of q [T, H, D], default b) over its seq_lens[b] keys, with the segment
    order of the module docstring. max_ctx: the longest context any sequence may have (sizes the segment
    buffer, so a CUDA graph serves every length up to it); programs: per (sequence, kv head), default from the
    batch (does not change the bits); counters as kernels.attention.decode_attention's; settings: decode_warps/
    decode_stages overriding ATTN's (launch shape only)."""
    from kernels.attention import default_splits

    st = {**ATTN, **(settings or {})}
    B = rows.shape[0]
    _, H, D = q.shape
    Hkv = k_pool.shape[1]
    group = H // Hkv
    bm = max(ATTN["decode_bm"], triton.next_power_of_2(group))
    if q_idx is None:
        q_idx = torch.arange(B, device=q.device, dtype=torch.int32)
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out
    if counters is None:
        counters = torch.zeros(B * Hkv, device=q.device, dtype=torch.int32)
    assert counters.numel() >= B * Hkv
    nseg = triton.cdiv(max_ctx, SEG_KV)
    programs = programs or min(nseg, default_splits(B, Hkv))
    nbuf = 1 if programs == 1 else nseg  # one program merges in registers: no partials kept
    mid_o = torch.empty(B, H, nbuf, D, device=q.device, dtype=torch.float32)
    mid_l = torch.empty(B, H, nbuf, device=q.device, dtype=torch.float32)  # strides: mid_o's / D
    _decode_kernel[(B, Hkv, programs)](
        q, k_pool, v_pool, out, table, rows, seq_lens, q_idx, mid_o, mid_l, counters,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        out.stride(0), out.stride(1), table.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        scale * _LOG2E,
        GROUP=group, D=D, BM=bm, BLOCK_N=_block_n(D), SEG=SEG_KV, ONE=programs == 1, num_warps=st["decode_warps"],
        num_stages=st["decode_stages"], **launch(q),
    )  # fmt: skip
    return out
