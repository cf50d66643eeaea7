"""Weights asked into L2 ahead of the launch that reads them (Hopper's `cp.async.bulk.prefetch.L2`): a hint that
reads no registers, writes nothing and is waited for by nobody, so it cannot change a result.

A decode step at small batch is a chain of short launches, and each ends a few µs later than its bytes need
(`perf/results/preload_h200/`): memory sits idle while a launch ramps up and drains, and through launches that
read little (the gated delta step, the attention of one token). A launch given `prefetch=weight` asks for that
weight (the next projection's) while it works, its programs each taking a share in `PIECES` bulk requests, so the
projection after it reads what it can from L2. `GpuHybrid` passes out_proj's weights to the delta step and
o_proj's to the decode attention (`TRITON_PD_L2_PREFETCH=1`, or `all` to have every `skinny_linear` launch also
ask for the next projection's weights after its own loop). Whatever is asked for beyond `budget()` bytes is left
out (H200's L2 is 50 MB, shared with what the launches read).

Off by default: timed on an H200 (2026-12-05, perf/results/l2_prefetch_h200/) it made every launch chain slower.
The layout's decode step took 1.18x / 1.03x / 1.02x as long at batch 1 / 32 / 128 (`all`: 1.73x at batch 1), and
8 chained MoE layers at one token 9.0x their roofline against 1.80x without. Kept as an opt-in experiment."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

PIECES = tl.constexpr(32)  # bulk requests per program


def mode(device: torch.device) -> str:
    """'' (off), 'on' (the delta step and the attention ask for the next weights) or 'all' (skinny_linear too):
    TRITON_PD_L2_PREFETCH=1 / all, CUDA devices of compute capability 9.0 and up only."""
    if device.type != "cuda":
        return ""
    v = os.environ.get("TRITON_PD_L2_PREFETCH", "0")
    if v in ("", "0") or torch.cuda.get_device_capability(device)[0] < 9:
        return ""
    return "all" if v == "all" else "on"


def budget() -> int:
    """Bytes one launch asks for at most (TRITON_PD_L2_PREFETCH_MB, default 24 MiB)."""
    return int(float(os.environ.get("TRITON_PD_L2_PREFETCH_MB", "24")) * 2**20)


def args(weight: torch.Tensor | None, like: torch.Tensor, min_mode: str = "on") -> dict:
    """The keyword arguments of a launch (whose tensors live where `like` does) that may ask for `weight`: PF (the
    tensor), PF_BYTES (its first bytes up to budget(), a multiple of 16) and PF_ON; off without a weight, below
    `min_mode` ("all": only when every launch asks), or for a weight that is not one contiguous run of 16-byte
    aligned bytes."""
    m = mode(like.device)
    on = weight is not None and bool(m) and (min_mode == "on" or m == "all")
    if on and (not weight.is_contiguous() or weight.data_ptr() % 16):
        on = False
    if not on:
        return {"PF": like, "PF_BYTES": 0, "PF_ON": False}
    nbytes = min(weight.numel() * weight.element_size(), budget()) // 16 * 16
    return {"PF": weight, "PF_BYTES": nbytes, "PF_ON": nbytes > 0}


@triton.jit
def _bulk_prefetch(ptrs, size):
    """One `cp.async.bulk.prefetch.L2.global` per element: size bytes (int32, a multiple of 16; none when 0) from
    ptrs (16-byte aligned). Its dummy result is not used; the asm is marked impure so that it stays."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptrs, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def prefetch(base, nbytes, pid, nprog, ON: tl.constexpr):
    """Program pid of nprog asks for its share of bytes [0, nbytes) at base (16-byte aligned, nbytes a multiple of
    16) to be read into L2, in PIECES bulk requests of a multiple of 16 bytes. A no-op unless ON."""
    if ON:
        piece = tl.cdiv(tl.cdiv(nbytes, nprog), 16 * PIECES) * 16
        offs = (pid * PIECES + tl.arange(0, PIECES)).to(tl.int64) * piece
        size = tl.minimum(tl.maximum(nbytes - offs, 0), piece).to(tl.int32)
        ptrs = base.to(tl.pointer_type(tl.int8)) + offs
        _bulk_prefetch(ptrs, size)


def slab_args(slabs: torch.Tensor | None, like: torch.Tensor, count: int) -> dict:
    """The keyword arguments of a launch that asks, per chosen expert, for the first bytes of that expert's weights
    (slabs [E, ...], one contiguous slab per expert): PF, PF_STRIDE (bytes from one slab to the next), PF_BYTES
    (per slab, so that `count` slabs stay within budget(), a multiple of 16) and PF_ON."""
    on = slabs is not None and bool(mode(like.device))
    if on:
        es = slabs.element_size()
        per = slabs[0].numel() * es
        on = slabs[0].is_contiguous() and slabs.data_ptr() % 16 == 0 and slabs.stride(0) * es % 16 == 0
    if not on:
        return {"PF": like, "PF_STRIDE": 0, "PF_BYTES": 0, "PF_ON": False}
    nbytes = min(per, budget() // max(count, 1)) // 16 * 16
    return {"PF": slabs, "PF_STRIDE": slabs.stride(0) * slabs.element_size(), "PF_BYTES": nbytes, "PF_ON": nbytes > 0}


@triton.jit
def prefetch_slabs(base, ids, valid, stride_bytes, nbytes, ON: tl.constexpr):
    """For each of ids [N] where valid: bytes [0, nbytes) of the slab at base + id * stride_bytes (16-byte aligned,
    nbytes a multiple of 16) asked into L2, in PIECES bulk requests. A no-op unless ON."""
    if ON:
        piece = tl.cdiv(nbytes, 16 * PIECES) * 16
        offs = tl.arange(0, PIECES).to(tl.int64) * piece
        size = tl.minimum(tl.maximum(nbytes - offs, 0), piece).to(tl.int32)
        ptrs = base.to(tl.pointer_type(tl.int8)) + ids.to(tl.int64)[:, None] * stride_bytes + offs[None, :]
        size = tl.where(valid[:, None], size[None, :], 0)
        _bulk_prefetch(ptrs, size)
