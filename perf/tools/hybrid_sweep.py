"""Launch settings of the hybrid decode step's kernels on a GPU, each timed as a CUDA graph over one call per layer
(so launch gaps and L2 behave as in the decode graph), at Qwen3-Next's per-layer shapes:

- `gated_delta_step`: value dims per state block (block_v), warps, the second block read with the first (ahead),
  a head's blocks shared among programs at a few sequences (split), and the state read before the
  programmatic-dependent-launch wait or after (preload), against the copy time of the state bytes it must read
  and write;
- `conv_step`, for the record;
- decode attention at head dim 256 (block_n, warps, stages, splits), against the copy time of its K/V bytes;
- the projections of random:qwen3-next-layout: cuBLAS against skinny_linear's candidates (kernels.linear.tune).

    python perf/kernels.py hybrid-steps [--batches 1 32 128] [--out FILE.md]"""

from __future__ import annotations

import argparse
import sys

import torch

from perf.tools.limits import bounded_report, needs_cuda


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--layers", type=int, default=12, help="calls per timed graph, each on its own buffers")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--linear-rows", type=int, nargs="*", default=[1, 16, 32, 64])
    parts = ["delta", "attention", "linear"]
    ap.add_argument("--parts", nargs="+", choices=parts, default=parts)
    ap.add_argument("--time-limit", type=float, default=300)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if needs_cuda("hybrid_sweep"):
        return 2
    from kernels import attention, delta_rule, linear
    from perf.tools.timing import copy_bandwidth, graph_time

    lines = [f"# Hybrid decode kernels on {torch.cuda.get_device_name()}", ""]
    rows: list[dict] = []
    write, timer = bounded_report(lines, a.out, rows, a.time_limit)
    bw = copy_bandwidth()
    lines += [f"Copy bandwidth {bw / 1e9:,.0f} GB/s. Command: `python perf/kernels.py hybrid-steps`.", ""]
    dev, L = "cuda", a.layers
    HK, HV, DK, DV, CONV = 16, 32, 128, 128, 2 * 16 * 128 + 32 * 128

    def timed(fn) -> float | str:
        try:
            return graph_time(fn, 20) / L
        except Exception as e:  # a setting that does not compile or fit
            return repr(e)[:80]

    lines += ["| kernel | batch | setting | per layer | bound | of bound |", "|---|---:|---|---:|---:|---:|"]

    def row(kernel, B, setting, t, bound):
        rows.append(dict(kernel=kernel, batch=B, setting=setting, seconds=t, bound=bound))
        if isinstance(t, str):
            lines.append(f"| {kernel} | {B} | {setting} | {t} | | |")
        else:
            lines.append(f"| {kernel} | {B} | {setting} | {t * 1e6:.1f} µs | {bound * 1e6:.1f} µs | {t / bound:.2f}x |")

    for B in a.batches if {"delta", "attention"} & set(a.parts) else []:
        pages = torch.arange(B, dtype=torch.int32, device=dev)
        states = [torch.randn(B, HV, DK, DV, device=dev) * 0.05 for _ in range(L)]
        convs = [torch.randn(B, CONV, 3, device=dev) for _ in range(L)]
        mixed = torch.randn(B, CONV, device=dev)
        proj = torch.randn(B, CONV + HV * DV + 2 * HV, device=dev, dtype=torch.bfloat16)
        a_log, dt_bias = torch.rand(HV, device=dev).log(), torch.zeros(HV, device=dev)
        norm_w, conv_w = torch.ones(DV, device=dev, dtype=torch.bfloat16), torch.randn(CONV, 4, device=dev)
        out = torch.empty(B, HV * DV, device=dev, dtype=torch.bfloat16)
        bound = 2 * B * HV * DK * DV * 4 / bw
        # (block_v, warps, second block read with the first, programs per head), each with the state read before and
        # after the PDL wait (every layer has a state of its own, so the launch before never wrote the one read);
        # a head shared among programs only at a few sequences (fewer programs than SMs)
        delta = [(128, 4, False, 1), (128, 8, False, 1), (64, 4, False, 1), (64, 8, False, 1), (32, 4, False, 1),
                 (16, 4, False, 1), (64, 4, True, 1), (64, 8, True, 1), (32, 4, True, 1), (32, 8, True, 1)]  # fmt: skip
        if B * HV < 4 * torch.cuda.get_device_properties(dev).multi_processor_count:
            delta += [(64, 4, False, 2), (64, 8, False, 2), (32, 4, False, 4), (32, 4, True, 2), (16, 4, False, 8)]
        counters = torch.zeros(B * HV, dtype=torch.int32, device=dev)
        grid = [(d, p) for d in delta for p in (False, True)] if "delta" in a.parts else []
        for (bv, warps, ahead, split), pre in grid:
            t = timed(lambda bv=bv, w=warps, pre=pre, ahead=ahead, split=split: [
                delta_rule.gated_delta_step(mixed, proj, a_log, dt_bias, norm_w, s, pages, HK, 1e-6, out=out,
                                            block_v=bv, num_warps=w, preload=pre, ahead=ahead, split=split,
                                            counters=counters) for s in states])  # fmt: skip
            row("gated_delta_step", B, f"block_v={bv} warps={warps} preload={pre} ahead={ahead} split={split}", t,
                bound)  # fmt: skip
        write()
        cout = torch.empty(B, CONV, device=dev)
        t = timed(lambda: [delta_rule.conv_step(proj, conv_w, c, pages, out=cout) for c in convs])
        row("conv_step", B, "block 256", t, 2 * B * CONV * 3 * 4 / bw)
        write()
        if "attention" not in a.parts:
            continue

        ctx, H, HKV, D = a.context, 16, 2, 256
        nslots = B * ctx
        pools = [(torch.randn(nslots, HKV, D, device=dev, dtype=torch.bfloat16),
                  torch.randn(nslots, HKV, D, device=dev, dtype=torch.bfloat16)) for _ in range(L)]  # fmt: skip
        table = torch.randperm(nslots, device=dev).to(torch.int32).view(B, ctx)
        rows_t = torch.arange(B, dtype=torch.int32, device=dev)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
        ao = torch.empty_like(q)
        counters = torch.zeros(B * HKV, dtype=torch.int32, device=dev)
        base = attention.default_splits(B, HKV)
        abound = 2 * B * ctx * HKV * D * 2 / bw
        for splits in sorted({base, max(1, base // 2), min(32, base * 2)}):
            for bn, warps, stages in ((64, 4, 2), (32, 4, 2), (64, 8, 2), (32, 4, 3), (64, 4, 1), (32, 8, 3)):
                t = timed(lambda s=splits, bn=bn, w=warps, st=stages: [
                    attention.decode_attention(q, kp, vp, table, rows_t, lens, 0.0625, out=ao, num_splits=s,
                                               block_n=bn, counters=counters, num_warps=w, num_stages=st)
                    for kp, vp in pools])  # fmt: skip
                row("decode_attention D=256", B, f"splits={splits} block_n={bn} warps={warps} stages={stages}", t,
                    abound)  # fmt: skip
        write()

    lines += ["", "| projection [N, K] | rows | cuBLAS | best skinny | of copy time | choice |"]
    lines += ["|---|---:|---:|---:|---:|---|"]
    shapes = (
        (12352, 2048, "in_proj"), (2048, 4096, "out/o"), (11264, 2048, "gate_up"), (2048, 5632, "down"),
        (2048, 5632, "down, silu fused"), (9216, 2048, "qkv"),
    ) if "linear" in a.parts else ()  # fmt: skip
    for N, K, name in shapes:
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(L)]
        for r in a.linear_rows:
            choice, times = linear.tune(ws, r, "silu" if "fused" in name else None)
            sk = [t for k, t in times.items() if k != "cublas" and not isinstance(t, str)]
            rows.append(dict(kernel="linear", name=name, rows=r, choice=choice, times=times))
            best = min(sk + [times["cublas"]])
            skinny = min(sk) * 1e6 if sk else float("nan")
            lines.append(f"| {name} [{N}, {K}] | {r} | {times['cublas'] * 1e6:.1f} µs | {skinny:.1f} µs | "
                         f"{best / (N * K * 2 / bw):.2f}x | {choice} |")  # fmt: skip
        write()
    timer.cancel()
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
