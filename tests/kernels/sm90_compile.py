"""Compiles the kernels that can ask for L2 prefetches (kernels.l2) for sm_90 with Triton's own ptxas, no GPU
needed, and prints one JSON line: per kernel, the PTX's count of bulk L2 prefetches and of PDL waits, with the
prefetch on and off. Run by tests/kernels/test_l2.py in a process without TRITON_INTERPRET."""

from __future__ import annotations

import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import attention, delta_rule, linear, moe

I32 = "*i32"


def _ptrs(names: str, dtype: str, **others: str) -> dict[str, str]:
    return {**{n: dtype for n in names.split()}, **others}


BUILDS = [
    (
        delta_rule._gated_delta_step_kernel,
        _ptrs(
            "Proj NormW Out PF",
            "*bf16",
            Mixed="*fp32",
            ALog="*fp32",
            DtBias="*fp32",
            S="*fp32",
            Pages=I32,
            OutPages=I32,
        ),  # fmt: skip
        {"eps", "q_scale"},
        dict(HV=32, R=2, KD=2048, DK=128, DV=128, BK=128, BV=128, NV=1, PRELOAD=True, PF_ON=True, PDL=True),
    ),
    (
        attention._decode_kernel,
        _ptrs(
            "Q K V O KNew VNew PF",
            "*bf16",
            Table=I32,
            Rows=I32,
            SeqLens=I32,
            QIdx=I32,
            Counter=I32,
            OutSlots=I32,
            MidO="*fp32",
            MidL="*fp32",
            Cos="*fp32",
            Sin="*fp32",
        ),  # fmt: skip
        {"scale_log2"},
        dict(
            GROUP=8,
            BLOCK_G=16,
            D=256,
            BLOCK_N=64,
            NUM_SPLITS=16,
            BLOCK_S=16,
            MERGE_G=8,
            PREC="tf32",
            FUSE_ROPE=False,
            PF_ON=True,
            PDL=True,
        ),  # fmt: skip
    ),
    (
        moe._router_kernel,
        _ptrs("Logits TopW PF", "*bf16", TopI=I32),
        set(),
        dict(K_TOP=8, NORM=True, SHARED=True, BE=256, KP=16, PF_ON=True, PDL=True),
    ),
    (
        linear._skinny_kernel,
        _ptrs(
            "X W Y G R RO NW PF",
            "*bf16",
            P="*fp32",
            C=I32,
            CS="*fp32",
            CW="*bf16",
            CPages=I32,
            COutPages=I32,
            Mixed="*fp32",
        ),  # fmt: skip
        {"eps"},
        dict(
            BLOCK_M=16,
            BLOCK_N=16,
            BLOCK_K=256,
            DOT=False,
            SPLITS=2,
            GATED=False,
            SIGMOID=False,
            NORM=False,
            HAS_RES=False,
            BLOCK_H=2048,
            PRELOAD=True,
            CONV=False,
            KM1=3,
            UNROLL=False,
            K_FIRST=256,
            K_SPLIT=0,
            PF_ON=True,
            PDL=True,
        ),  # fmt: skip
    ),
]


def ptx(fn, pointers: dict[str, str], floats: set[str], constexprs: dict) -> str:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = "fp32" if name in floats else "i32"
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def counts(text: str) -> dict[str, int]:
    lines = text.splitlines()
    return {
        "prefetch": sum("cp.async.bulk.prefetch.L2.global" in ln for ln in lines),
        "wait": sum("griddepcontrol.wait" in ln for ln in lines),
    }


def main() -> None:
    out = {}
    for fn, pointers, floats, constexprs in BUILDS:
        out[fn.__name__] = {
            "on": counts(ptx(fn, pointers, floats, constexprs)),
            "off": counts(ptx(fn, pointers, floats, {**constexprs, "PF_ON": False})),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
