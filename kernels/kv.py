"""Moving K/V rows in Triton: storing a batch's new rows into the pool, and copying rows from one pool's slots to
another pool's slots for every layer (the prefill -> decode hand-off; the destination may be another process's
pool opened through CUDA IPC, on this GPU or a peer)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kernel(K, V, KP, VP, Slots, stride_kt, stride_vt, stride_ps, ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    tl.store(KP + slot * stride_ps + offs, tl.load(K + t * stride_kt + offs, mask=mask), mask=mask)
    tl.store(VP + slot * stride_ps + offs, tl.load(V + t * stride_vt + offs, mask=mask), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor):
    """k, v: [T, Hkv, D] (rows with unit stride inside a token); k_pool/v_pool: [S, Hkv, D]; slots: [T] int."""
    T, H, D = k.shape
    if T == 0:
        return
    assert k.stride(1) == D and v.stride(1) == D and k_pool.stride(0) == v_pool.stride(0) == H * D
    _store_kernel[(T,)](
        k, v, k_pool, v_pool, slots, k.stride(0), v.stride(0), k_pool.stride(0),
        ROW=H * D, BLOCK=triton.next_power_of_2(H * D), num_warps=4,
    )  # fmt: skip


@triton.jit
def _copy_kernel(
    Src, Dst, SrcSlots, DstSlots, stride_src_part, stride_dst_part, ROW: tl.constexpr, BLOCK: tl.constexpr
):
    i = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)  # layer * 2 + (0 for K, 1 for V)
    s = tl.load(SrcSlots + i).to(tl.int64)
    d = tl.load(DstSlots + i).to(tl.int64)
    for c in tl.static_range(0, ROW, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        mask = offs < ROW
        x = tl.load(Src + part * stride_src_part + s * ROW + offs, mask=mask)
        tl.store(Dst + part * stride_dst_part + d * ROW + offs, x, mask=mask)


def copy_kv(src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor):
    """dst[:, :, dst_slots] = src[:, :, src_slots] for buffers [layers, 2, slots, Hkv, D] (each contiguous).
    Runs on src's device; dst may live on another GPU (peer access, as CUDA IPC maps it)."""
    L, two, _, H, D = src.shape
    n = src_slots.numel()
    if n == 0:
        return
    assert src.is_contiguous() and dst.is_contiguous() and dst.shape[3:] == src.shape[3:]
    row = H * D
    _copy_kernel[(n, L * two)](
        src, dst, src_slots, dst_slots, src.stride(1), dst.stride(1),
        ROW=row, BLOCK=min(1024, triton.next_power_of_2(row)), num_warps=4,
    )  # fmt: skip
