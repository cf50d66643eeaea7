"""Decode attention launch settings on the GPU: for each batch size, every (splits, block_n, num_warps, num_stages)
in the grid, timed as the decode graph runs it (the fused rotary + KV store variant, 32 layers' pools, one CUDA
graph of 32 launches per setting), against the KV bytes each launch must read at the copy bandwidth measured in the
same run. Prints the best settings per batch and how the current defaults (`attention.decode_settings`) compare.

    python perf/kernels.py decode-attention [--batches 1 8 32 64 128] [--context 1024] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from perf.tools.engine_bench import print_report  # noqa: E402
from perf.tools.timing import copy_bandwidth  # noqa: E402

LAYERS, H, HKV, D = 32, 32, 8, 128  # Llama-3.1-8B


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from kernels import attention, rope
    from kernels.linear import graph_time

    dev = "cuda"
    bw = copy_bandwidth()
    ctx = a.context
    bmax = max(a.batches)
    slots = bmax * ctx + 1
    pools = [torch.randn(2, slots, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    table = torch.arange(bmax * ctx, device=dev, dtype=torch.int32).view(bmax, ctx)
    table = torch.cat([torch.zeros(1, ctx, dtype=torch.int32, device=dev), table])  # row 0: padding, as the runner
    cos, sin = rope.rope_cache(1.0 / (500000.0 ** (torch.arange(0, D, 2).float() / D)), 4 * ctx, dev)
    lines = [f"# Decode attention settings ({torch.cuda.get_device_name()}, context {ctx}, H={H}, Hkv={HKV}, D={D})",
             "", f"Command: `python perf/kernels.py decode-attention {' '.join(sys.argv[1:])}`  ",
             f"Copy bandwidth measured in this run: {bw / 1e12:.2f} TB/s. Times are per layer (a graph of {LAYERS} "
             "launches over separate pools, divided by 32).", ""]  # fmt: skip
    res = {"bandwidth_TBps": bw / 1e12, "batches": {}}
    for B in a.batches:
        qkv = torch.randn(B, H + 2 * HKV, D, device=dev, dtype=torch.bfloat16)
        q, k, v = qkv[:, :H], qkv[:, H : H + HKV], qkv[:, H + HKV :]
        out = torch.empty(B, H, D, device=dev, dtype=torch.bfloat16)
        rows = torch.arange(1, B + 1, device=dev, dtype=torch.int32)
        seq = torch.full((B,), ctx, device=dev, dtype=torch.int32)
        out_slots = table[rows.long(), ctx - 1].clone()
        counters = torch.zeros(B * HKV, device=dev, dtype=torch.int32)
        qidx = torch.arange(B, device=dev, dtype=torch.int32)
        kv_bytes = B * ctx * HKV * D * 2 * 2
        rows_out = []

        def run(sp, bn, w, st, q=q, k=k, v=v, out=out, rows=rows, seq=seq, out_slots=out_slots, counters=counters,
                qidx=qidx):  # fmt: skip
            for p in pools:
                attention.decode_attention(
                    q, p[0], p[1], table, rows, seq, D**-0.5, out=out, q_idx=qidx, num_splits=sp, block_n=bn,
                    counters=counters, rope=(k, v, cos, sin, out_slots), num_warps=w, num_stages=st,
                )  # fmt: skip

        default = attention.decode_settings(B, HKV)
        grid = set(itertools.product(a.splits, a.block_n, a.warps, a.stages))
        grid.add((default["num_splits"], default["block_n"], default["num_warps"], default["num_stages"]))
        t0 = time.perf_counter()
        for sp, bn, w, st in sorted(grid):
            try:
                t = graph_time(partial(run, sp, bn, w, st)) / LAYERS
            except Exception as e:  # a setting that does not compile (shared memory) is reported, not fatal
                print(f"b={B} splits={sp} block_n={bn} warps={w} stages={st}: {type(e).__name__}", flush=True)
                continue
            rows_out.append({"splits": sp, "block_n": bn, "warps": w, "stages": st, "us": t * 1e6})
        rows_out.sort(key=lambda r: r["us"])
        d = next(r for r in rows_out if (r["splits"], r["block_n"], r["warps"], r["stages"]) ==
                 (default["num_splits"], default["block_n"], default["num_warps"], default["num_stages"]))  # fmt: skip
        floor = kv_bytes / bw * 1e6
        print(f"b={B}: best {rows_out[0]}, default {d}, KV floor {floor:.1f} us ({time.perf_counter() - t0:.0f} s)",
              flush=True)  # fmt: skip
        res["batches"][B] = {"rows": rows_out, "default": d, "floor_us": floor}
        lines += [f"## Batch {B}", "",
                  f"KV read at the copy bandwidth: {floor:.1f} µs per layer. Defaults ({d['splits']} splits, "
                  f"block {d['block_n']}, {d['warps']} warps, {d['stages']} stages): **{d['us']:.1f} µs**.", "",
                  "| splits | block_n | warps | stages | µs per layer |", "|---|---|---|---|---|"]  # fmt: skip
        for r in rows_out[:8]:
            lines.append(f"| {r['splits']} | {r['block_n']} | {r['warps']} | {r['stages']} | {r['us']:.1f} |")
        lines.append("")
    return print_report(lines, res, a.out, a.json)


if __name__ == "__main__":
    sys.exit(main())
