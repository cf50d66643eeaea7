"""The paged prefill attention kernel (kernels.attention.prefill_attention) against PyTorch's flash attention on the
same tokens, in the same run, on a GPU.

One sequence of `--tokens` causal tokens per shape, bf16. The kernel reads K/V through a slot table: once with the
slots in order and once scattered (a random permutation of the pool, as a served request's slots may be); the
reference is `F.scaled_dot_product_attention(is_causal=True)` on contiguous [1, H, T, D] tensors (the flash backend
where it applies). Printed per setting: time, TFLOP/s (causal: 2 * T^2 * H * D multiply-adds), time over the
reference's, and the largest difference to it. `--sweep` adds block and warp settings (each compiled once).

    python perf/kernels.py prefill-attention [--tokens 8192] [--shapes layout qwen3.5-9b] [--sweep] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch
import torch.nn.functional as F

from perf.tools.limits import bounded_report, finish
from perf.tools.timing import cuda_median, wall_median

# (query heads, KV heads, head dim) of the full-attention layers
SHAPES = {
    "layout": (16, 2, 256),  # random:qwen3-next-layout
    "qwen3.5-9b": (16, 4, 256),
    "llama3.1-8b": (32, 8, 128),
}
SWEEP = [
    dict(block_m=64, block_n=32, num_warps=8, num_stages=2),
    dict(block_m=64, block_n=64, num_warps=8, num_stages=2),
    dict(block_m=128, block_n=32, num_warps=8, num_stages=2),
    dict(block_m=64, block_n=32, num_warps=4, num_stages=3),
    dict(block_m=128, block_n=64, num_warps=8, num_stages=2),
    dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
    dict(block_m=128, block_n=128, num_warps=8, num_stages=2),
    dict(block_m=128, block_n=32, num_warps=4, num_stages=2),
]


def timed(fn, reps: int, cpu: bool) -> float:
    """Median seconds of one call of fn(): CUDA events, or the wall clock for --cpu (perf.tools.timing)."""
    return wall_median(fn, reps) if cpu else cuda_median(fn, reps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--shapes", nargs="+", default=["layout", "qwen3.5-9b"], choices=sorted(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="also time the block/warp settings in SWEEP")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--time-limit", type=float, default=240, help="wall-clock bound; what was measured is written")
    ap.add_argument("--out", default=None, help="markdown file for the results (also printed), plus .json beside it")
    # a smoke run of the script itself through Triton's interpreter (TRITON_INTERPRET=1, small --tokens, float32)
    ap.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available() and not a.cpu:
        print("prefill_attention_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    from kernels import attention

    T, dev = a.tokens, "cpu" if a.cpu else "cuda"
    dtype = torch.float32 if a.cpu else torch.bfloat16
    device_name = "CPU (Triton's interpreter)" if a.cpu else torch.cuda.get_device_name()
    rows: list[dict] = []
    lines = [
        f"# Prefill attention on {device_name}, one causal sequence of {T:,} tokens, {str(dtype)[6:]}",
        "",
        f"Command: `python perf/kernels.py prefill-attention {' '.join(sys.argv[1:] if argv is None else argv)}`",
        "",
        "| shape (H, Hkv, D) | what | setting | time | TFLOP/s | / flash SDPA | max abs diff |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    write, timer = bounded_report(lines, a.out, rows, a.time_limit)
    gen = torch.Generator(device=dev).manual_seed(0)
    for name in a.shapes:
        H, Hkv, D = SHAPES[name]
        flops = 2 * T * T * H * D  # causal: half of 4 T^2 H D
        q = torch.randn(T, H, D, device=dev, generator=gen).to(dtype)
        k = torch.randn(T, Hkv, D, device=dev, generator=gen).to(dtype)
        v = torch.randn(T, Hkv, D, device=dev, generator=gen).to(dtype)
        qs, ks, vs = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v))

        sdpa = partial(F.scaled_dot_product_attention, qs, ks, vs, is_causal=True, scale=D**-0.5, enable_gqa=True)

        t_ref = timed(sdpa, a.reps, a.cpu)
        ref = sdpa()[0].transpose(0, 1).float()
        shape = f"{name} ({H}, {Hkv}, {D})"
        lines.append(f"| {shape} | PyTorch SDPA (flash), contiguous | | {t_ref * 1e3:.2f} ms | "
                     f"{flops / t_ref / 1e12:.0f} | 1.00x | |")  # fmt: skip
        rows.append(dict(shape=name, what="sdpa", s=t_ref))
        write()
        pool = T + 64
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
        for order in ("in order", "scattered"):
            slots = torch.arange(T, device=dev) if order == "in order" else torch.randperm(pool, device=dev)[:T]
            k_pool = torch.zeros(pool, Hkv, D, dtype=dtype, device=dev)
            v_pool = torch.zeros_like(k_pool)
            k_pool[slots], v_pool[slots] = k, v
            table = torch.zeros(2, T, dtype=torch.int32, device=dev)
            table[1] = slots.int()
            args = (table, i32([1]), i32([0]), i32([T]), i32([T]), T, D**-0.5)
            settings = [{}] + (SWEEP if a.sweep and order == "in order" else [])
            for setting in settings:
                run = partial(attention.prefill_attention, q, k_pool, v_pool, *args, out=torch.empty_like(q), **setting)

                try:
                    t = timed(run, a.reps, a.cpu)
                except Exception as e:  # a setting past the device's shared memory: listed, not fatal
                    lines.append(f"| {shape} | kernel, slots {order} | {setting or 'default'} | "
                                 f"{type(e).__name__} | | | |")  # fmt: skip
                    write()
                    continue
                diff = (run().float() - ref).abs().max().item()
                lines.append(
                    f"| {shape} | kernel, slots {order} | {setting or 'default'} | {t * 1e3:.2f} ms | "
                    f"{flops / t / 1e12:.0f} | {t / t_ref:.2f}x | {diff:.1e} |"
                )
                rows.append(dict(shape=name, what=f"kernel {order}", setting=setting, s=t, ratio=t / t_ref, diff=diff))
                write()
    return finish(timer, lines, write)


if __name__ == "__main__":
    sys.exit(main())
