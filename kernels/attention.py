"""Attention over the slot-indexed KV pool, in Triton.

Both kernels read K and V through a slot table: `table[row, i]` is the pool slot holding position i of the sequence
that owns `row`. The pool for one layer is K[slot, kv_head, :] / V[slot, kv_head, :] (token granularity, no pages).

- `decode_attention`: one query token per sequence, grouped-query heads handled together (one program loads each
  K/V row once for every query head of its group), the context split into `num_splits` parts computed in parallel
  and merged by log-sum-exp (split-KV, "flash-decoding") by whichever split finishes last, in the same kernel. The
  split count is fixed per call, so the launch is graph-capturable while sequence lengths change.
- `prefill_attention`: ragged query blocks (sequence i owns rows [q_start[i], q_start[i] + q_len[i])) over a context
  of ctx_len[i] keys whose last q_len[i] are the new tokens; causal, so a query at position p sees keys [0, p].
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.pdl import enter, launch
from kernels.rope import cos_sin

_LOG2E = 1.4426950408889634


@triton.jit
def _gate(g_ptr, mask, dtype):
    """Sigmoid of the gate at g_ptr rounded to dtype as torch.sigmoid rounds it (in float32)."""
    g = tl.load(g_ptr, mask=mask, other=0.0).to(tl.float32)
    return (1.0 / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)


@triton.jit
def _gated(out, sig, dtype, GATE: tl.constexpr):
    """The attention output in the output's dtype; with GATE times `_gate`'s sigmoid, the product rounded (a gated
    attention output, Qwen3-Next and Qwen3.5: torch.sigmoid, then the product)."""
    out = out.to(dtype)
    if GATE:
        out = (out.to(tl.float32) * sig).to(dtype)
    return out


@triton.jit
def _decode_kernel(
    Q, K, V, Table, Rows, SeqLens, QIdx, MidO, MidL, O, Counter, KNew, VNew, Cos, Sin, OutSlots, Gate,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tr,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_t, stride_h,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_c, stride_gt,
    scale_log2,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, MERGE_G: tl.constexpr, PREC: tl.constexpr, FUSE_ROPE: tl.constexpr, GATE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    row = tl.load(Rows + b).to(tl.int64)
    qrow = tl.load(QIdx + b).to(tl.int64)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    mask_g = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q_ptr = Q + qrow * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_ptr + offs_d[None, :], mask=mask_g[:, None], other=0.0)
    kend = end
    if FUSE_ROPE:
        # rotate q here (half-split layout: element d pairs with d +- D/2), and leave the new token (position
        # seq_len - 1) out of the loop: the split that owns it rotates its k, stores k and v into the pool and
        # adds it from registers below
        pos = (seq_len - 1).to(tl.int64)
        c, sn = cos_sin(Cos, Sin, pos, stride_c, offs_d, D)
        HALF: tl.constexpr = D // 2
        q_sw = tl.load(q_ptr + ((offs_d + HALF) % D)[None, :], mask=mask_g[:, None], other=0.0)
        q = (q.to(tl.float32) * c[None, :] + q_sw.to(tl.float32) * sn[None, :]).to(Q.dtype.element_ty)
        kend = tl.minimum(end, seq_len - 1)

    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    for n0 in range(start, kend, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kend
        slots = tl.load(Table + row * stride_tr + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(K + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2  # [G, N], in log2 units
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new

    if FUSE_ROPE:
        if (start <= seq_len - 1) & (seq_len - 1 < end):
            kn_ptr = KNew + qrow * stride_knt + kvh * stride_knh
            kn = tl.load(kn_ptr + offs_d).to(tl.float32) * c + tl.load(kn_ptr + (offs_d + HALF) % D).to(tl.float32) * sn
            kn = kn.to(K.dtype.element_ty)
            vn = tl.load(VNew + qrow * stride_vnt + kvh * stride_vnh + offs_d)
            slot = tl.load(OutSlots + qrow).to(tl.int64)
            tl.store(K + slot * stride_ks + kvh * stride_kh + offs_d, kn)
            tl.store(V + slot * stride_vs + kvh * stride_vh + offs_d, vn)
            s_new = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], 1) * scale_log2  # [G]
            m_new = tl.maximum(m, s_new)
            alpha = tl.exp2(m - m_new)
            p_new = tl.exp2(s_new - m_new)
            l_sum = l_sum * alpha + p_new
            acc = acc * alpha[:, None] + p_new[:, None] * vn.to(tl.float32)[None, :]
            m = m_new

    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    if NUM_SPLITS == 1:
        o_ptr = O + qrow * stride_t + heads[:, None] * stride_h + offs_d[None, :]
        sig = 0.0
        if GATE:
            sig = _gate(Gate + qrow * stride_gt + heads[:, None] * D + offs_d[None, :], mask_g[:, None],
                        O.dtype.element_ty)  # fmt: skip
        out = _gated(out, sig, O.dtype.element_ty, GATE)
        tl.store(o_ptr, out, mask=mask_g[:, None])
    else:
        lse = tl.where(end > start, m + tl.log2(tl.where(l_sum > 0, l_sum, 1.0)), float("-inf"))
        tl.store(
            MidO + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :],
            out,
            mask=mask_g[:, None],
        )
        tl.store(MidL + b * stride_lb + heads * stride_lh + split, lse, mask=mask_g)
        offs_mg = tl.arange(0, MERGE_G)
        hm = kvh * GROUP + offs_mg
        # the gate read by every split before the count, so the merging one has it when it gets there
        sig = 0.0
        if GATE:
            sig = _gate(Gate + qrow * stride_gt + hm[:, None] * D + offs_d[None, :], (offs_mg < GROUP)[:, None],
                        O.dtype.element_ty)  # fmt: skip
        # the last split to finish for this (sequence, kv head) merges all of them (no second kernel): every thread's
        # stores are ordered before the counter's release by the barrier, as in CUTLASS's semaphore
        tl.debug_barrier()
        done = tl.atomic_add(Counter + b * tl.num_programs(1) + kvh, 1, sem="acq_rel")
        if done == NUM_SPLITS - 1:
            # one load of every split's partial for the group's heads: [MERGE_G, BLOCK_S, D], from L2 (.cg: this SM
            # may hold stale lines of these addresses from an earlier launch)
            offs_s = tl.arange(0, BLOCK_S)
            mask_gs = (offs_mg < GROUP)[:, None] & (offs_s < NUM_SPLITS)[None, :]
            ls = tl.load(MidL + b * stride_lb + hm[:, None] * stride_lh + offs_s[None, :], mask=mask_gs,
                         other=float("-inf"), cache_modifier=".cg")  # fmt: skip
            w = tl.exp2(ls - tl.max(ls, 1)[:, None])
            w = w / tl.sum(w, 1)[:, None]
            part = tl.load(
                MidO + b * stride_ob + hm[:, None, None] * stride_oh + offs_s[None, :, None] * stride_os
                + offs_d[None, None, :], mask=mask_gs[:, :, None], other=0.0, cache_modifier=".cg",
            )  # fmt: skip
            res = tl.sum(part * w[:, :, None], 1)
            o_ptr = O + qrow * stride_t + hm[:, None] * stride_h + offs_d[None, :]
            res = _gated(res, sig, O.dtype.element_ty, GATE)
            tl.store(o_ptr, res, mask=(offs_mg < GROUP)[:, None])
            tl.store(Counter + b * tl.num_programs(1) + kvh, 0)  # ready for the next launch (graph replays)


def _precision(q: torch.Tensor) -> str:
    """float32 inputs are multiplied in full precision (no TF32), so float32 results match PyTorch's closely."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def default_splits(batch: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """Enough (batch, kv head, split) programs for about two waves over the multiprocessors, at most 16 splits (the
    last split merges them all in one load). Under Triton's CPU interpreter, which runs the programs one after
    another, 2: the fewest that still take the split-and-merge path (16 made a tiny model's decode step 8x slower
    there)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return 2
    want = max(1, (2 * num_sms + batch * num_kv_heads - 1) // (batch * num_kv_heads))
    return min(16, 1 << (want - 1).bit_length())


def decode_settings(batch: int, num_kv_heads: int, head_dim: int = 128) -> dict:
    """Launch settings of `decode_attention` for a decode graph of `batch` sequences (keyword arguments). Heads of
    256 dims (Qwen3-Next, Qwen3.5) take smaller key blocks once there are 64 or more (sequence, kv head) pairs, and
    eight warps below that (perf/kernels.py hybrid-steps on an H200: 71 against 105 µs at batch 128 with 2 kv heads, 8.0
    against 9.5 µs at batch 1); from 64 to 127 pairs, 4 splits and 3 stages (one wave of programs at two an SM: at
    the layout's batch 32 on an H100, 31.6 against 37.3 µs a layer alone and 0.04 ms off the decode step, where 256
    pairs lost 0.14 ms with 3 stages: perf/results/attn_kvp_h100, attn_preload_h100, instep_h100)."""
    settings = {"num_splits": default_splits(batch, num_kv_heads), "block_n": 64, "num_warps": 4, "num_stages": 2}
    pairs = batch * num_kv_heads
    if head_dim >= 256:
        settings.update({"block_n": 32} if pairs >= 64 else {"num_warps": 8})
        if 64 <= pairs < 128:
            settings.update({"num_splits": min(4, settings["num_splits"]), "num_stages": 3})
    return settings


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    q_idx: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int = 64,
    counters: torch.Tensor | None = None,
    rope: tuple | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D] (rows q_idx[b] are the queries, default b); k_pool/v_pool: [slots, Hkv, D];
    table: [R, max_ctx] int32; rows, seq_lens: [B] int32. Returns out [T, H, D] with rows q_idx written.
    counters: int32 zeros, at least B * Hkv of them, that the kernel leaves zeroed (pass a persistent buffer under
    CUDA graphs; by default a fresh one).

    rope = (k, v, cos, sin, out_slots) fuses the rotary embedding and the KV store of the new token into the
    kernel (what `rope.rope_store_kv_` would do first): q and k ([T, Hkv, D], as the projection left them) are
    rotated at position seq_lens[b] - 1 with cos/sin [max_position, D/2]; the rotated k and v go into the pool at
    out_slots[q_idx[b]], and the table's entry for that position is not read. q itself is left unrotated.

    gate [T, H * D] (unit stride along its row, rows as q's): the output is attention * sigmoid(gate), what
    `out * torch.sigmoid(gate)` would give after it (a gated attention's output, in the same launch)."""
    B = rows.shape[0]
    _, H, D = q.shape
    Hkv = k_pool.shape[1]
    group = H // Hkv
    if q_idx is None:
        q_idx = torch.arange(B, device=q.device, dtype=torch.int32)
    if out is None:
        out = torch.empty_like(q)
    splits = num_splits or default_splits(B, Hkv)
    if counters is None:
        counters = torch.zeros(B * Hkv, device=q.device, dtype=torch.int32)
    assert counters.numel() >= B * Hkv
    mid_o = torch.empty(B, H, splits, D, device=q.device, dtype=torch.float32)
    mid_l = torch.empty(B, H, splits, device=q.device, dtype=torch.float32)
    if rope is not None:
        k_new, v_new, cos, sin, out_slots = rope
        assert k_new.stride(2) == v_new.stride(2) == 1 and cos.shape[1] * 2 == D
        rope_args = (k_new, v_new, cos, sin, out_slots)
        rope_strides = (k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), cos.stride(0))
    else:
        rope_args = (q, q, q, q, rows)  # unused
        rope_strides = (0, 0, 0, 0, 0)
    if gate is not None:
        assert gate.shape[-1] == H * D and gate.stride(-1) == 1, "gate: [T, H * D], unit stride along a row"
    _decode_kernel[(B, Hkv, splits)](
        q, k_pool, v_pool, table, rows, seq_lens, q_idx, mid_o, mid_l, out, counters, *rope_args,
        q if gate is None else gate,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        table.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_l.stride(0), mid_l.stride(1),
        out.stride(0), out.stride(1), *rope_strides, 0 if gate is None else gate.stride(0),
        scale * _LOG2E,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=D, BLOCK_N=block_n, NUM_SPLITS=splits,
        BLOCK_S=max(2, triton.next_power_of_2(splits)), MERGE_G=triton.next_power_of_2(group), PREC=_precision(q),
        FUSE_ROPE=rope is not None, GATE=gate is not None, num_warps=num_warps,
        num_stages=num_stages, **launch(q),
    )  # fmt: skip
    return out


@triton.jit
def _prefill_block(q, acc, m, l_sum, n0, end, qpos, K, V, Table, row, stride_tr, stride_ks, stride_kh, stride_vs,
                   stride_vh, kvh, offs_d, scale_log2, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
                   MASKED: tl.constexpr):  # fmt: skip
    """One block of BLOCK_N keys from n0 into the online softmax. MASKED: the block may reach past `end` or past a
    query's position (the causal diagonal); otherwise every key in it is visible to every query of the block."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        mask_n = offs_n < end
        slots = tl.load(Table + row * stride_tr + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(K + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    else:
        slots = tl.load(Table + row * stride_tr + offs_n).to(tl.int64)
        k = tl.load(K + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :])
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
    if MASKED:
        keep = mask_n[None, :] & (offs_n[None, :] <= qpos[:, None])  # key 0 is always kept: no all -inf row
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(V + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    else:
        v = tl.load(V + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return acc, m_new, l_sum


@triton.jit
def _prefill_kernel(
    Q, K, V, O, Table, Rows, QStart, QLen, CtxLen,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_tr,
    scale_log2,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Program (sequence, query block, head). Query blocks in reverse order: the last (the most keys) start first,
    so the short ones fill the tail. Key blocks wholly at or before the block's first query position take no mask;
    the rest (the diagonal, the context's end) do."""
    i = tl.program_id(0)
    mb = tl.num_programs(1) - 1 - tl.program_id(1)
    h = tl.program_id(2)
    q_len = tl.load(QLen + i)
    q_start = tl.load(QStart + i).to(tl.int64)
    ctx = tl.load(CtxLen + i)
    row = tl.load(Rows + i).to(tl.int64)
    kvh = h // GROUP
    prefix = ctx - q_len
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    mask_m = offs_m < q_len
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=mask_m[:, None])
    qpos = prefix + offs_m
    # blocks past this sequence's queries see no keys: the loops are empty and the store masked
    live = mb * BLOCK_M < q_len
    end = tl.where(live, tl.minimum(ctx, prefix + (mb + 1) * BLOCK_M), 0)
    # keys [0, full) are visible to every query of the block (key n <= the first query's position)
    full = tl.where(live, tl.minimum((prefix + mb * BLOCK_M + 1) // BLOCK_N * BLOCK_N, end), 0)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for n0 in range(0, full, BLOCK_N):
        acc, m, l_sum = _prefill_block(q, acc, m, l_sum, n0, end, qpos, K, V, Table, row, stride_tr, stride_ks,
                                       stride_kh, stride_vs, stride_vh, kvh, offs_d, scale_log2, BLOCK_N, PREC,
                                       False)  # fmt: skip
    for n0 in range(full, end, BLOCK_N):
        acc, m, l_sum = _prefill_block(q, acc, m, l_sum, n0, end, qpos, K, V, Table, row, stride_tr, stride_ks,
                                       stride_kh, stride_vs, stride_vh, kvh, offs_d, scale_log2, BLOCK_N, PREC,
                                       True)  # fmt: skip
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(
        O + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(O.dtype.element_ty),
        mask=mask_m[:, None],
    )


def prefill_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    ctx_len: torch.Tensor,
    max_q_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int = 64,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> torch.Tensor:
    """q: [T, H, D]; rows/q_start/q_len/ctx_len: [N] int32 per sequence. Returns out [T, H, D] (rows of the
    sequences written; others untouched). block_m: queries per program (default 64; 128 for heads over 128 dims);
    block_n: keys per step; num_warps: default 4, 8 for heads over 128 dims. For 256-dim heads (Qwen3-Next,
    Qwen3.5) 128 x 64 in 8 warps took 1.30 ms for 8,192 causal tokens on an H200 against 4.69 ms for the earlier
    64 x 32 (`perf/kernels.py prefill-attention --sweep`, which times the settings against PyTorch's flash
    attention; perf/results/prefill_attention_h200)."""
    N = rows.shape[0]
    _, H, D = q.shape
    group = H // k_pool.shape[1]
    if out is None:
        out = torch.empty_like(q)
    if block_m is None:
        block_m = 64 if D <= 128 else 128
    grid = (N, triton.cdiv(max_q_len, block_m), H)
    _prefill_kernel[grid](
        q, k_pool, v_pool, out, table, rows, q_start, q_len, ctx_len,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        out.stride(0), out.stride(1), table.stride(0),
        scale * _LOG2E,
        GROUP=group, D=D, BLOCK_M=block_m, BLOCK_N=block_n, PREC=_precision(q),
        num_warps=num_warps or (4 if D <= 128 else 8), num_stages=num_stages,
    )  # fmt: skip
    return out
