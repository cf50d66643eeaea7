"""SiLU(gate) * up over a fused [T, 2F] gate/up projection, in Triton (one read of each, one write)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import enter, launch


@triton.jit
def _silu_mul_kernel(GU, Out, stride_gu, stride_o, F, BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < F
    g = tl.load(GU + t * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + t * stride_gu + F + offs, mask=mask, other=0.0)
    # rounded like F.silu(g) * u in the activation dtype
    s = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(Out + t * stride_o + offs, (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    T, two_f = gate_up.shape
    f = two_f // 2
    if out is None:
        out = torch.empty(T, f, dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return out
    block = 1024
    _silu_mul_kernel[(T, triton.cdiv(f, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), f, BLOCK=block, **launch(gate_up)
    )
    return out
