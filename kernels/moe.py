"""A fused mixture-of-experts MLP: tokens grouped by expert, one grouped GEMM launch per projection, no Python loop
over experts and no host synchronisation (so it can be captured in a CUDA graph).

    routed(x, top_i, top_w, gate_up, down) = sum over k of top_w[t, k] * down[e] (silu(g) * u),  (g | u) = gate_up[e] x
    with e = top_i[t, k]

- `route`: the router's softmax and top-k (renormalised or not) in one launch per batch.
- `align`: the (token, k) pairs sorted by expert, each expert's run padded to a whole block of `block_m` rows
  (sentinel rows past the pairs), and each block's expert (-1: an unused block): a memset and two Triton launches
  for decode batches (sentinels and counts, then runs, pairs and block experts, in parallel programs), PyTorch
  device ops past `ALIGN_MAX_PAIRS`. The grid is sized by an upper bound (`align_bound`), not by
  the counts, so nothing waits for the device.
- `_gate_up_kernel`: per (block, block of intermediate columns) the rows' gate and up projections with the block's
  expert, SiLU(gate) * up in the epilogue, stored in sorted order.
- a few tokens (`SMALL_BATCH`): `_pair_gate_up_kernel` and `_token_down_kernel`, matrix-vector products per pair
  and per token (the K down projections summed in pair order in the same launch): two launches, no alignment.
- `_down_kernel`: per (block, block of hidden columns) the down projection, scaled by the routing weight, stored in
  fp32 at the pair's row; `_combine_kernel` sums the K pairs of a token in a fixed order (deterministic, no
  atomics) and adds the shared expert's sigmoid-gated output.

Weights as the checkpoints stack them (backends.common.model.hybrid_model.stack_experts): gate_up [E, 2I, H] (gate rows,
then up rows), down [E, H, I]. The PyTorch reference is HybridModel.mlp's loop over experts. Fine-grained FP8
experts (`routed(..., fp8=...)`): the two grouped GEMMs read e4m3 tiles and their block scales and quantize their
activation tiles per row and block (kernels.fp8's W8A8 scheme); they always take the grouped path."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import _quantize_tile, supported
from kernels.pdl import enter, launch

BLOCK_M = 16


ALIGN_MAX_PAIRS = 4096  # up to here `align` runs in Triton (decode batches); past it, PyTorch device ops


def align_bound(n: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted pair list for n pairs: every expert's run padded to whole blocks, at most
    n + min(experts, n) x (block_m - 1) rows, rounded up to a block."""
    return triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m) * block_m


@triton.jit
def _align_count_kernel(TopI, Counts, Pairs, n, P, BR: tl.constexpr, PDL: tl.constexpr):
    """Per block of BR rows: the sentinel n in the sorted list's rows, and the block's pairs counted per expert
    (integer atomics: the counts do not depend on their order)."""
    enter(PDL)
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    tl.store(Pairs + r, tl.zeros((BR,), dtype=tl.int32) + n, mask=r < P)
    fe = tl.load(TopI + r, mask=r < n, other=0).to(tl.int32)
    tl.atomic_add(Counts + fe, tl.full((BR,), 1, tl.int32), mask=r < n)


@triton.jit
def _align_scatter_kernel(TopI, Counts, Pairs, BlockExpert, n, nb,
                          BM: tl.constexpr, BE: tl.constexpr, BR: tl.constexpr, BQ: tl.constexpr,
                          BB: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Each program: the runs' starts from the counts (each expert's run padded to BM rows); BR pairs each stored
    at its expert's start + its rank among the earlier pairs of that expert (the pairs' own order: the list is
    deterministic); and the expert of BB blocks (-1 past the used ones)."""
    enter(PDL)
    i = tl.program_id(0)
    e = tl.arange(0, BE)
    padded = (tl.load(Counts + e) + BM - 1) // BM * BM
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    c = i * BR
    if c < n:
        rp = c + tl.arange(0, BR)
        fe = tl.load(TopI + rp, mask=rp < n, other=0).to(tl.int32)
        rank = tl.zeros((BR,), dtype=tl.int32)
        for c2 in range(0, c + BR, BQ):
            rq = c2 + tl.arange(0, BQ)
            ge = tl.load(TopI + rq, mask=rq < n, other=-2).to(tl.int32)
            earlier = (ge[None, :] == fe[:, None]) & (rq[None, :] < rp[:, None])
            rank += tl.sum(earlier.to(tl.int32), axis=1)
        start = tl.sum(tl.where(e[None, :] == fe[:, None], starts[None, :], 0), axis=1)
        tl.store(Pairs + start + rank, rp, mask=rp < n)
    rb = i * BB + tl.arange(0, BB)
    first = rb * BM
    be = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
    tl.store(BlockExpert + rb, tl.where(first < tl.sum(padded, 0), be, -1), mask=rb < nb)


def align(top_i: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """top_i [T, K] expert ids. Returns (sorted_pairs [P] int32: pair indices t * K + k in expert order, each
    expert's run padded to a multiple of block_m with the sentinel T * K; block_expert [P / block_m] int32, -1 for
    a block past the used ones). The grid is sized by `align_bound`, never by the counts: nothing waits for the
    device, so this can be captured in a CUDA graph."""
    n = top_i.numel()
    P = align_bound(n, num_experts, block_m)
    if n <= ALIGN_MAX_PAIRS:
        be = triton.next_power_of_2(num_experts)
        nb = P // block_m
        pairs = torch.empty(P + nb, dtype=torch.int32, device=top_i.device)
        pairs, block_expert = pairs[:P], pairs[P:]
        counts = torch.zeros(be, dtype=torch.int32, device=top_i.device)
        flat = top_i.reshape(-1)
        _align_count_kernel[(triton.cdiv(P, 256),)](flat, counts, pairs, n, P, BR=256, **launch(flat))
        br, bb = 32, max(16, min(64, 8192 // be))
        grid = max(triton.cdiv(n, br), triton.cdiv(nb, bb))
        _align_scatter_kernel[(grid,)](flat, counts, pairs, block_expert, n, nb, BM=block_m, BE=be, BR=br, BQ=256,
                                       BB=bb, **launch(flat))  # fmt: skip
        return pairs, block_expert
    return _align_torch(top_i, num_experts, block_m, P)


def _align_torch(top_i: torch.Tensor, num_experts: int, block_m: int, P: int):
    """`align` for large batches (prefill) in PyTorch device ops: same result."""
    dev = top_i.device
    flat = top_i.reshape(-1).long()
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.sort(flat, stable=True).indices  # pair indices, grouped by expert
    expert_sorted = flat[order]
    first_of = torch.cumsum(counts, 0) - counts  # where each expert's pairs begin in `order`
    rank = torch.arange(n, device=dev) - first_of[expert_sorted]
    sorted_pairs = torch.full((P,), n, dtype=torch.int32, device=dev)
    sorted_pairs[starts[expert_sorted] + rank] = order.to(torch.int32)
    block_first_row = torch.arange(P // block_m, device=dev) * block_m
    block_expert = torch.searchsorted(ends, block_first_row, right=True)
    used = block_first_row < ends[-1]
    block_expert = torch.where(used, block_expert, torch.full_like(block_expert, -1)).to(torch.int32)
    return sorted_pairs, block_expert


@triton.jit
def _gate_up_kernel(
    X, W, WS, Inter, Pairs, BlockExpert, H, I, n_pairs, stride_x, stride_we, stride_wn, stride_wse, stride_wsn,
    K_TOP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """FP8: W holds e4m3 weights and WS [E, 2I, H / BK] their row scales per column block (BK is the block):
    each [BM, BK] tile of x is quantized per row (kernels.fp8's W8A8 scheme) and each block's product added in
    float32 times both scales."""
    enter(PDL)
    b, nb = tl.program_id(0), tl.program_id(1)
    e = tl.load(BlockExpert + b)
    if e < 0:
        return
    rm = b * BM + tl.arange(0, BM)
    pair = tl.load(Pairs + rm)
    valid = pair < n_pairs
    tok = tl.where(valid, pair // K_TOP, 0).to(tl.int64)
    rn = nb * BN + tl.arange(0, BN)
    mn = rn < I
    w_base = W + e.to(tl.int64) * stride_we
    ws_base = WS + e.to(tl.int64) * stride_wse
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < H
        a = tl.load(X + tok[:, None] * stride_x + rk[None, :], mask=valid[:, None] & mk[None, :], other=0.0)
        wg = tl.load(w_base + rn[None, :] * stride_wn + rk[:, None], mask=mk[:, None] & mn[None, :], other=0.0)
        wu = tl.load(w_base + (I + rn)[None, :] * stride_wn + rk[:, None], mask=mk[:, None] & mn[None, :], other=0.0)
        if FP8:
            qa, sa = _quantize_tile(a.to(tl.float32))
            sg = tl.load(ws_base + rn * stride_wsn + k0 // BK, mask=mn, other=0.0)
            su = tl.load(ws_base + (I + rn) * stride_wsn + k0 // BK, mask=mn, other=0.0)
            acc_g += tl.dot(qa, wg, out_dtype=tl.float32) * sa[:, None] * sg[None, :]
            acc_u += tl.dot(qa, wu, out_dtype=tl.float32) * sa[:, None] * su[None, :]
        else:
            acc_g += tl.dot(a, wg)
            acc_u += tl.dot(a, wu)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(Inter + rm.to(tl.int64)[:, None] * I + rn[None, :], h.to(Inter.dtype.element_ty), mask=mn[None, :])


@triton.jit
def _down_kernel(
    Inter, W, WS, Wt, Out, Pairs, BlockExpert, H, I, n_pairs, stride_we, stride_wn, stride_wse, stride_wsn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """FP8: as in _gate_up_kernel, the intermediate rows quantized per row and column block."""
    enter(PDL)
    b, nb = tl.program_id(0), tl.program_id(1)
    e = tl.load(BlockExpert + b)
    if e < 0:
        return
    rm = b * BM + tl.arange(0, BM)
    pair = tl.load(Pairs + rm)
    valid = pair < n_pairs
    rn = nb * BN + tl.arange(0, BN)
    mn = rn < H
    w_base = W + e.to(tl.int64) * stride_we
    ws_base = WS + e.to(tl.int64) * stride_wse
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < I
        a = tl.load(Inter + rm.to(tl.int64)[:, None] * I + rk[None, :], mask=mk[None, :], other=0.0)
        w = tl.load(w_base + rn[None, :] * stride_wn + rk[:, None], mask=mk[:, None] & mn[None, :], other=0.0)
        if FP8:
            qa, sa = _quantize_tile(a.to(tl.float32))
            sw = tl.load(ws_base + rn * stride_wsn + k0 // BK, mask=mn, other=0.0)
            acc += tl.dot(qa, w, out_dtype=tl.float32) * sa[:, None] * sw[None, :]
        else:
            acc += tl.dot(a, w)
    weight = tl.load(Wt + pair, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    dst = tl.where(valid, pair, 0).to(tl.int64)
    tl.store(Out + dst[:, None] * H + rn[None, :], acc.to(Out.dtype.element_ty), mask=valid[:, None] & mn[None, :])


@triton.jit
def _router_kernel(Logits, TopI, TopW, E, stride_l,
                   K_TOP: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr, BE: tl.constexpr,
                   KP: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Per token: softmax over the E experts (fp32), the top K by repeated arg-max (highest first, the lowest index
    on a tie), renormalised over the K when NORM; SHARED: one more pair, expert E with weight sigmoid(logit E).
    The weights are rounded to TopW's dtype once, at the store (KP: K_TOP + SHARED rounded up to a power of 2)."""
    enter(PDL)
    t = tl.program_id(0)
    e = tl.arange(0, BE)
    row = Logits + t.to(tl.int64) * stride_l
    z = tl.load(row + e, mask=e < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(z - tl.max(z, 0))
    p = p / tl.sum(p, 0)
    K_OUT: tl.constexpr = K_TOP + SHARED
    kk = tl.arange(0, KP)
    ids = tl.zeros([KP], dtype=tl.int32)
    ws = tl.zeros([KP], dtype=tl.float32)
    total = 0.0
    for k in tl.static_range(K_TOP):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, e, BE), 0)
        ids = tl.where(kk == k, idx, ids)
        ws = tl.where(kk == k, best, ws)
        total += best
        p = tl.where(e == idx, -1.0, p)
    if NORM:
        ws = ws / total
    if SHARED:
        g = tl.load(row + E).to(tl.float32)
        ids = tl.where(kk == K_TOP, E, ids)
        ws = tl.where(kk == K_TOP, 1.0 / (1.0 + tl.exp(-g)), ws)
    out = t * K_OUT
    tl.store(TopI + out + kk, ids, mask=kk < K_OUT)
    tl.store(TopW + out + kk, ws.to(TopW.dtype.element_ty), mask=kk < K_OUT)


def route(logits: torch.Tensor, top_k: int, norm: bool, dtype: torch.dtype, num_experts: int | None = None,
          shared: bool = False, num_warps: int | None = None):  # fmt: skip
    """The router's softmax and top-k in one launch: (top_w [T, K] in dtype, top_i [T, K] int32), as
    torch.topk(softmax(logits[:, :E], fp32)) (then / sum when norm, then rounded to dtype) gives them; E =
    num_experts (default: every column). shared: logits[:, E] is a shared expert's gate, added as pair K (expert E,
    weight its sigmoid). num_warps: per token (default SETTINGS["route_warps"]; fewer warps, fewer barriers in
    the K rounds of arg-max)."""
    T = logits.shape[0]
    E = logits.shape[1] if num_experts is None else num_experts
    k_out = top_k + int(shared)
    top_i = torch.empty((T, k_out), dtype=torch.int32, device=logits.device)
    top_w = torch.empty((T, k_out), dtype=dtype, device=logits.device)
    if T:
        _router_kernel[(T,)](logits, top_i, top_w, E, logits.stride(0), K_TOP=top_k, NORM=norm, SHARED=shared,
                             BE=triton.next_power_of_2(E), KP=max(2, triton.next_power_of_2(k_out)),
                             num_warps=num_warps or SETTINGS["route_warps"], **launch(logits))  # fmt: skip
    return top_w, top_i


@triton.jit
def _combine_kernel(PerPair, Out, Shared, Gate, H, stride_gate,
                    K_TOP: tl.constexpr, HAS_SHARED: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """out[t] = sum over k (in order) of per_pair[t, k] (+ sigmoid(gate[t]) * shared[t]), in fp32."""
    enter(PDL)
    t, hb = tl.program_id(0), tl.program_id(1)
    rh = hb * BH + tl.arange(0, BH)
    m = rh < H
    row = t.to(tl.int64)
    acc = tl.zeros((BH,), dtype=tl.float32)
    for k in tl.static_range(K_TOP):
        acc += tl.load(PerPair + (row * K_TOP + k) * H + rh, mask=m, other=0.0).to(tl.float32)
    if HAS_SHARED:
        g = tl.load(Gate + row * stride_gate).to(tl.float32)
        s = tl.load(Shared + row * H + rh, mask=m, other=0.0).to(tl.float32)
        acc += s / (1.0 + tl.exp(-g))
    tl.store(Out + row * H + rh, acc.to(Out.dtype.element_ty), mask=m)


@triton.jit
def _pair_gate_up_kernel(X, W, TopI, Inter, H, I, stride_x, stride_we, stride_wn,
                         K_TOP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Small batches: per (pair, block of intermediate columns) SiLU(gate) * up of the pair's token with its
    expert, as a matrix-vector product (no grouping: each expert is read by the few pairs that use it)."""
    enter(PDL)
    p, nb = tl.program_id(0), tl.program_id(1)
    e = tl.load(TopI + p).to(tl.int64)
    x_row = X + (p // K_TOP).to(tl.int64) * stride_x
    rn = nb * BN + tl.arange(0, BN)
    mn = rn < I
    w_base = W + e * stride_we
    acc_g = tl.zeros((BN,), dtype=tl.float32)
    acc_u = tl.zeros((BN,), dtype=tl.float32)
    for k0 in range(0, H, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < H
        a = tl.load(x_row + rk, mask=mk, other=0.0).to(tl.float32)
        m2 = mn[:, None] & mk[None, :]
        wg = tl.load(w_base + rn[:, None] * stride_wn + rk[None, :], mask=m2, other=0.0)
        wu = tl.load(w_base + (I + rn)[:, None] * stride_wn + rk[None, :], mask=m2, other=0.0)
        acc_g += tl.sum(wg.to(tl.float32) * a[None, :], axis=1)
        acc_u += tl.sum(wu.to(tl.float32) * a[None, :], axis=1)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(Inter + p.to(tl.int64) * I + rn, h.to(Inter.dtype.element_ty), mask=mn)


@triton.jit
def _token_down_kernel(Inter, W, TopI, TopW, Out, H, I, stride_we, stride_wn,
                       K_TOP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRELOAD: tl.constexpr,
                       KP: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Small batches: per (token, block of hidden columns) the down projections of the token's K pairs, each
    scaled by its routing weight and summed in pair order in fp32 (the combine, without a launch of its own).
    PRELOAD (I <= BK): the pairs' experts, weights and weight tiles ([KP, BN, BK], KP >= K_TOP) are loaded before
    waiting for the launch before (the SiLU-mul's); TopI and TopW come from the launch before that one, which has
    finished once the launch before started this one (every launch here waits first: kernels.pdl)."""
    t, nb = tl.program_id(0), tl.program_id(1)
    rn = nb * BN + tl.arange(0, BN)
    mn = rn < H
    out = tl.zeros((BN,), dtype=tl.float32)
    if PRELOAD:
        kk = tl.arange(0, KP)
        mp = kk < K_TOP
        rk = tl.arange(0, BK)
        mk = rk < I
        pairs = t * K_TOP + kk
        e = tl.load(TopI + pairs, mask=mp, other=0).to(tl.int64)
        pw = tl.load(TopW + pairs, mask=mp, other=0.0).to(tl.float32)
        w3 = tl.load(W + e[:, None, None] * stride_we + rn[None, :, None] * stride_wn + rk[None, None, :],
                     mask=mp[:, None, None] & mn[None, :, None] & mk[None, None, :], other=0.0)  # fmt: skip
        enter(PDL)
        a = tl.load(Inter + pairs.to(tl.int64)[:, None] * I + rk[None, :], mask=mp[:, None] & mk[None, :], other=0.0)
        acc = tl.sum(w3.to(tl.float32) * a.to(tl.float32)[:, None, :], axis=2)  # [KP, BN]
        for k in tl.static_range(K_TOP):  # pair order; each pick adds zeros to one value, exactly
            out += tl.sum(tl.where(kk[:, None] == k, acc, 0.0), 0) * tl.sum(tl.where(kk == k, pw, 0.0), 0)
    else:
        enter(PDL)
        for k in tl.static_range(K_TOP):
            p = t * K_TOP + k
            e = tl.load(TopI + p).to(tl.int64)
            w_base = W + e * stride_we
            acc = tl.zeros((BN,), dtype=tl.float32)
            for k0 in range(0, I, BK):
                rk = k0 + tl.arange(0, BK)
                mk = rk < I
                a = tl.load(Inter + p.to(tl.int64) * I + rk, mask=mk, other=0.0).to(tl.float32)
                w = tl.load(w_base + rn[:, None] * stride_wn + rk[None, :], mask=mn[:, None] & mk[None, :],
                            other=0.0)  # fmt: skip
                acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
            out += acc * tl.load(TopW + p).to(tl.float32)
    tl.store(Out + t.to(tl.int64) * H + rn, out.to(Out.dtype.element_ty), mask=mn)


SMALL_BATCH = 2  # tokens up to which `routed` takes the matrix-vector path (two launches, no grouping)


# Launch settings: the two grouped GEMMs' tiles (columns per program, reduction step, warps, stages), the
# matrix-vector path's (small_*) and the batch up to which that path is taken, chosen on the H200 with
# `python perf/engine.py moe --sweep` (perf/results/moe_h200/; the small path's preload and the route's warps:
# perf/results/preload_h200/).
SETTINGS = {"bn": 64, "bk": 128, "warps": 4, "stages": 3, "down_bn": 64, "down_bk": 64, "down_warps": 4,
            "down_stages": 3, "small_batch": SMALL_BATCH, "small_bn": 8, "small_bk": 512, "small_down_bn": 2,
            "small_down_bk": 512, "small_warps": 4, "small_down_warps": 4, "small_preload": True,
            "route_warps": 1, "fp8_bn": 32}  # fmt: skip
# fp8_bn: the FP8 gate/up GEMM's columns per program (BK is the scale block): compiled for sm_90 at 4 warps, 64
# columns spill 720 bytes per thread, 32 none (perf/tools/kernel_regs.resource_use; not yet timed on a GPU)


def routed(x, top_i, top_w, gate_up, down, shared=None, block_m: int = BLOCK_M, settings=None,
           fp8=None) -> torch.Tensor:  # fmt: skip
    """x [T, H]; top_i [T, K] expert ids; top_w [T, K] routing weights; gate_up [E, 2I, H]; down [E, H, I] (unit
    stride in the last dim); shared: None or (gate [T, 1] logits, out [T, H]) of a shared expert, added as
    sigmoid(gate) * out. Returns the sum [T, H] in x's dtype, accumulated in fp32 in a fixed order.
    fp8: (gate_up scales [E, 2I, ceil(H / group)], down scales [E, H, ceil(I / group)], group) when gate_up and
    down hold e4m3 weights (fine-grained FP8, backends/common/model/fp8.py): the W8A8 scheme of kernels.fp8, the
    activations quantized per row and group inside the grouped GEMMs (always the grouped path)."""
    T, H = x.shape
    E, two_i, _ = gate_up.shape
    I = two_i // 2  # noqa: E741
    K = top_i.shape[1]
    if T == 0:
        return torch.zeros_like(x)
    assert x.stride(1) == 1 and gate_up.stride(2) == 1 and down.stride(2) == 1
    st = SETTINGS if settings is None else {**SETTINGS, **settings}
    if fp8 is not None:
        gu_scale, down_scale, group = fp8
        if not supported(group):
            raise ValueError(f"routed: an FP8 column block must be a multiple of 32 up to 256, got {group}")
        st = {**st, "bk": group, "down_bk": group, "bn": st["fp8_bn"]}
    elif T <= st["small_batch"] and shared is None:
        return _routed_small(x, top_i, top_w, gate_up, down, st)
    else:
        gu_scale = down_scale = x  # not read
    pairs, block_expert = align(top_i, E, block_m)
    P = pairs.numel()
    inter = torch.empty((P, I), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(P // block_m, triton.cdiv(I, st["bn"]))](
        x, gate_up, gu_scale, inter, pairs, block_expert, H, I, T * K, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), gu_scale.stride(0), gu_scale.stride(1), K_TOP=K, BM=block_m, BN=st["bn"], BK=st["bk"],
        FP8=fp8 is not None, num_warps=st["warps"], num_stages=st["stages"], **launch(x),
    )  # fmt: skip
    per_pair = torch.empty((T * K, H), dtype=torch.float32, device=x.device)
    _down_kernel[(P // block_m, triton.cdiv(H, st["down_bn"]))](
        inter, down, down_scale, top_w.reshape(-1).contiguous(), per_pair, pairs, block_expert, H, I, T * K,
        down.stride(0), down.stride(1), down_scale.stride(0), down_scale.stride(1), BM=block_m, BN=st["down_bn"],
        BK=st["down_bk"], FP8=fp8 is not None, num_warps=st["down_warps"], num_stages=st["down_stages"],
        **launch(x),
    )  # fmt: skip
    out = torch.empty_like(x)
    gate, sh = shared if shared is not None else (per_pair, per_pair)
    bh = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, bh))](
        per_pair, out, sh, gate, H, gate.stride(0), K_TOP=K, HAS_SHARED=shared is not None, BH=bh, **launch(x),
    )  # fmt: skip
    return out


def _routed_small(x, top_i, top_w, gate_up, down, st) -> torch.Tensor:
    """`routed` for a few tokens: per pair gate/up + SiLU-mul, then per token the K down projections and their
    weighted sum, as matrix-vector products (no alignment, no combine launch)."""
    T, H = x.shape
    I = gate_up.shape[1] // 2  # noqa: E741
    K = top_i.shape[1]
    inter = torch.empty((T * K, I), dtype=x.dtype, device=x.device)
    top_i, top_w = top_i.contiguous(), top_w.contiguous()  # any copy before the first launch: see _token_down_kernel
    _pair_gate_up_kernel[(T * K, triton.cdiv(I, st["small_bn"]))](
        x, gate_up, top_i, inter, H, I, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        K_TOP=K, BN=st["small_bn"], BK=st["small_bk"], num_warps=st["small_warps"], **launch(x),
    )  # fmt: skip
    out = torch.empty_like(x)
    preload = st["small_preload"] and I <= st["small_down_bk"]
    _token_down_kernel[(T, triton.cdiv(H, st["small_down_bn"]))](
        inter, down, top_i, top_w, out, H, I, down.stride(0), down.stride(1),
        K_TOP=K, BN=st["small_down_bn"], BK=st["small_down_bk"], PRELOAD=preload,
        KP=triton.next_power_of_2(K), num_warps=st["small_down_warps"], **launch(x),
    )  # fmt: skip
    return out
