"""Tile settings of kernels.invariant.linear on a GPU: each candidate (rows and columns per tile, BLOCK_K, warps,
stages) timed per projection shape and row count against cuBLAS (F.linear) in the same run, and every candidate's
output compared bit for bit with the first one's (the deterministic mode relies on the tile never changing a
row's bits).

    python perf/kernels.py invariant [--shapes llama3.1-8b] [--rows 1 8 32 128 8192] [--time-limit 240] [--out F.md]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from perf.tools.timing import unrolled_graph_time

SHAPES = {  # (name, N, K) of one layer's projections and the LM head
    "llama3.1-8b": [
        ("qkv", 6144, 4096),
        ("o", 4096, 4096),
        ("gate_up", 28672, 4096),
        ("down", 4096, 14336),
        ("lm_head", 128256, 4096),
    ],  # fmt: skip
}


def candidates(rows: int) -> list[dict]:
    out = []
    for bm, bn, bk, stages in itertools.product((64, 128), (16, 32, 64, 128, 256), (64, 128, 256), (3, 4, 5)):
        if (bm + bn) * bk * 2 * stages > 220 * 1024:
            continue
        if rows >= 1024 and (bm < 128 or bn < 128):
            continue
        if rows < 1024 and (stages == 5 or (bm == 128 and rows <= 64)):
            continue
        for warps in (4, 8) if bm == 128 else (4,):
            if rows >= 1024 or warps == 8 or bm == 64:
                out.append(dict(bm=bm, bn=bn, bk=bk, warps=warps, stages=stages))
    if rows >= 1024:  # the persistent TMA kernel
        for bn, stages, flatten in itertools.product((128, 256), (3, 4), (False, True)):
            out.append(dict(tma=True, bm=128, bn=bn, bk=64, warps=8, stages=stages, flatten=flatten))
    return out


def write_report(out: str, lines: list[str], results: list[dict]) -> None:
    """The markdown table (with the time of measuring) at `out`, the raw results beside it as JSON."""
    Path(out).write_text("\n".join(lines + [f"\nMeasured {time.strftime('%Y-%m-%d %H:%M')}."]) + "\n")
    Path(out).with_suffix(".json").write_text(json.dumps(results, indent=1))


def try_candidates(cands: list[dict], run, reps: int, stop=lambda: False) -> tuple[list[tuple], int]:
    """Each setting's run(setting) timed (graph replays of `reps` calls) and its output compared bitwise with the
    first that ran. Returns ([(seconds or inf, setting, error text)], how many differ); stops early when stop()."""
    first, times, differ = None, [], 0
    for st in cands:
        if stop():
            break
        try:
            y = run(st).clone()
            torch.cuda.synchronize()
        except Exception as e:  # a setting the compiler refuses (resources): listed, not fatal
            times.append((float("inf"), st, repr(e)[:80]))
            continue
        if first is None:
            first = y
        elif not torch.equal(y, first):
            differ += 1
        times.append((unrolled_graph_time(lambda st=st: run(st), reps), st, ""))
    return times, differ


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 8192])
    ap.add_argument("--reps", type=int, default=20, help="calls per timed graph (3 from 1,024 rows)")
    ap.add_argument("--time-limit", type=float, default=240.0)
    ap.add_argument("--out", default="invariant_sweep.md")
    a = ap.parse_args()
    from kernels import invariant

    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    lines = [
        f"# kernels.invariant.linear tile settings ({torch.cuda.get_device_name(0)}, bf16)",
        "",
        f"Command: `python perf/kernels.py invariant {' '.join(sys.argv[1:])}`",
        "",
        "| projection | N x K | rows | cuBLAS | default settings | best | best settings | best / cuBLAS | "
        "candidates differing bitwise |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|",
    ]

    write = partial(write_report, a.out, lines, results)

    for name, N, K in SHAPES[a.shapes]:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * K**-0.5
        for m in a.rows:
            if time.time() - t0 > a.time_limit:
                lines.append(f"\n(time limit reached before {name} at {m} rows)")
                write()
                return 0
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            reps = a.reps if m < 1024 else 3
            t_cublas = unrolled_graph_time(lambda x=x, w=w: F.linear(x, w), reps)
            t_default = unrolled_graph_time(lambda x=x, w=w: invariant.linear(x, w), reps)
            run = lambda st, x=x, w=w: invariant.linear(x, w, settings=st)  # noqa: E731
            times, differ = try_candidates(candidates(m), run, reps)
            best_t, best_st, _ = min(times, key=lambda r: r[0])
            results.append(dict(name=name, N=N, K=K, rows=m, cublas=t_cublas, default=t_default, differ=differ,
                                candidates=[dict(t=t, **st, error=e) for t, st, e in times]))  # fmt: skip
            lines.append(
                f"| {name} | {N} x {K} | {m} | {t_cublas * 1e6:.1f} us | {t_default * 1e6:.1f} us | "
                f"{best_t * 1e6:.1f} us | {best_st} | {best_t / t_cublas:.2f} | {differ} of {len(times) - 1} |"
            )
            print(lines[-1], flush=True)
            write()
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
