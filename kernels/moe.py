"""A fused mixture-of-experts MLP: tokens grouped by expert, one grouped GEMM launch per projection, no Python loop
over experts and no host synchronisation (so it can be captured in a CUDA graph).

    routed(x, top_i, top_w, gate_up, down) = sum over k of top_w[t, k] * down[e] (silu(g) * u),  (g | u) = gate_up[e] x
    with e = top_i[t, k]

- `align`: the (token, k) pairs sorted by expert, each expert's run padded to a whole block of `block_m` rows
  (sentinel rows past the pairs), and each block's expert (-1: an unused block), in device ops only. The grid is
  sized by an upper bound (pairs + min(experts, pairs) x (block_m - 1) rows), not by the counts, so nothing waits
  for the device.
- `_gate_up_kernel`: per (block, block of intermediate columns) the rows' gate and up projections with the block's
  expert, SiLU(gate) * up in the epilogue, stored in sorted order.
- `_down_kernel`: per (block, block of hidden columns) the down projection, scaled by the routing weight, stored at
  the pair's row; the K pairs of a token are then summed in a fixed order (deterministic, no atomics).

Weights as the checkpoints stack them (backends.common.hybrid_model.stack_experts): gate_up [E, 2I, H] (gate rows,
then up rows), down [E, H, I]. The PyTorch reference is HybridModel.mlp's loop over experts."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16


def align(top_i: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """top_i [T, K] expert ids. Returns (sorted_pairs [P] int32: pair indices t * K + k in expert order, each
    expert's run padded to a multiple of block_m with the sentinel T * K; block_expert [P / block_m] int32, -1 for
    a block past the used ones)."""
    dev = top_i.device
    flat = top_i.reshape(-1).long()
    n = flat.numel()
    bound = n + min(num_experts, n) * (block_m - 1)
    P = triton.cdiv(bound, block_m) * block_m
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
    X, W, Inter, Pairs, BlockExpert, H, I, n_pairs, stride_x, stride_we, stride_wn,
    K_TOP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
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
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < H
        a = tl.load(X + tok[:, None] * stride_x + rk[None, :], mask=valid[:, None] & mk[None, :], other=0.0)
        wg = tl.load(w_base + rn[None, :] * stride_wn + rk[:, None], mask=mk[:, None] & mn[None, :], other=0.0)
        wu = tl.load(w_base + (I + rn)[None, :] * stride_wn + rk[:, None], mask=mk[:, None] & mn[None, :], other=0.0)
        acc_g += tl.dot(a, wg)
        acc_u += tl.dot(a, wu)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(Inter + rm.to(tl.int64)[:, None] * I + rn[None, :], h.to(Inter.dtype.element_ty), mask=mn[None, :])


@triton.jit
def _down_kernel(
    Inter, W, Wt, Out, Pairs, BlockExpert, H, I, n_pairs, stride_we, stride_wn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
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
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < I
        a = tl.load(Inter + rm.to(tl.int64)[:, None] * I + rk[None, :], mask=mk[None, :], other=0.0)
        w = tl.load(w_base + rn[None, :] * stride_wn + rk[:, None], mask=mk[:, None] & mn[None, :], other=0.0)
        acc += tl.dot(a, w)
    weight = tl.load(Wt + pair, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    dst = tl.where(valid, pair, 0).to(tl.int64)
    tl.store(Out + dst[:, None] * H + rn[None, :], acc.to(Out.dtype.element_ty), mask=valid[:, None] & mn[None, :])


def routed(x, top_i, top_w, gate_up, down, block_m: int = BLOCK_M) -> torch.Tensor:
    """x [T, H]; top_i [T, K] expert ids; top_w [T, K] routing weights; gate_up [E, 2I, H]; down [E, H, I] (unit
    stride in the last dim). Returns the routed experts' sum [T, H] in x's dtype (the shared expert is not here)."""
    T, H = x.shape
    E, two_i, _ = gate_up.shape
    I = two_i // 2  # noqa: E741
    K = top_i.shape[1]
    out = torch.zeros_like(x)
    if T == 0:
        return out
    assert x.stride(1) == 1 and gate_up.stride(2) == 1 and down.stride(2) == 1
    pairs, block_expert = align(top_i, E, block_m)
    P = pairs.numel()
    inter = torch.empty((P, I), dtype=x.dtype, device=x.device)
    bn, bk = 64, 32
    _gate_up_kernel[(P // block_m, triton.cdiv(I, bn))](
        x, gate_up, inter, pairs, block_expert, H, I, T * K, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        K_TOP=K, BM=block_m, BN=bn, BK=bk,
    )  # fmt: skip
    per_pair = torch.empty((T * K, H), dtype=x.dtype, device=x.device)
    _down_kernel[(P // block_m, triton.cdiv(H, bn))](
        inter, down, top_w.reshape(-1).contiguous(), per_pair, pairs, block_expert, H, I, T * K,
        down.stride(0), down.stride(1), BM=block_m, BN=bn, BK=bk,
    )  # fmt: skip
    return per_pair.view(T, K, H).sum(1, dtype=torch.float32).to(x.dtype)
