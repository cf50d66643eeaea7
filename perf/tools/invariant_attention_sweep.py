"""Launch settings of kernels.invariant's attention on a GPU: decode (programs per (sequence, kv head), warps,
stages) and prefill (query rows per tile, warps, stages), each candidate timed against the default kernels
(kernels.attention) in the same run and its output compared bit for bit with the first candidate's (the
deterministic mode relies on launch settings never changing a query's bits). The rotary embedding + K/V store
launch that the deterministic decode step runs apart (the default fuses it into attention) is timed too.

    python perf/kernels.py invariant-attention [--batches 1 32 128] [--context 1024] [--prefill 8192]
        [--time-limit 200] [--out F.md]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from functools import partial

import torch

from perf.tools.invariant_sweep import try_candidates, write_report
from perf.tools.timing import unrolled_graph_time

H, HKV, D = 32, 8, 128  # Llama-3.1-8B's attention


def pool(tokens: int, gen: torch.Generator):
    """K/V pools of `tokens` slots (plus a spare) and a random slot order (a paged table)."""
    k = torch.randn(tokens + 1, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(tokens + 1, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    perm = torch.randperm(tokens, device="cuda", generator=gen).to(torch.int32)
    return k, v, perm


def decode_candidates() -> list[dict]:
    return [
        dict(programs=p, decode_warps=w, decode_stages=s)
        for p, w, s in itertools.product((None, 1, 2, 4), (4, 8), (2, 3, 4))
    ]


def prefill_candidates() -> list[dict]:
    return [dict(bm=bm, warps=w, stages=s) for bm, w, s in itertools.product((64, 128), (4, 8), (2, 3))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max-ctx", type=int, default=131072, help="the longest context a graph serves (segment buffer)")
    ap.add_argument("--prefill", type=int, default=8192, help="prompt tokens of the prefill case (0: none)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--time-limit", type=float, default=200.0)
    ap.add_argument("--out", default="invariant_attention_sweep.md")
    a = ap.parse_args()
    from kernels import attention, invariant, rope

    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = D**-0.5
    results: list[dict] = []
    lines = [
        f"# kernels.invariant attention launch settings ({torch.cuda.get_device_name(0)}, bf16, {H} heads, "
        f"{HKV} kv heads, dim {D})",
        "",
        f"Command: `python perf/kernels.py invariant-attention {' '.join(sys.argv[1:])}`",
        "",
        "| case | default kernel | deterministic, current settings | best | best settings | best / default | "
        "candidates differing bitwise |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]

    write = partial(write_report, a.out, lines, results)

    def sweep(case: str, t_default: float, run, cands: list[dict]) -> None:
        t_current = unrolled_graph_time(lambda: run(None), a.reps)
        times, differ = try_candidates(cands, run, a.reps, stop=lambda: time.time() - t0 > a.time_limit)
        if len(times) < len(cands):
            lines.append(f"\n(time limit reached in {case})")
        best_t, best_st, _ = min(times, key=lambda r: r[0])
        results.append(dict(case=case, default=t_default, current=t_current, differ=differ,
                            candidates=[dict(t=t, **st, error=e) for t, st, e in times]))  # fmt: skip
        lines.append(
            f"| {case} | {t_default * 1e6:.1f} us | {t_current * 1e6:.1f} us | {best_t * 1e6:.1f} us | {best_st} | "
            f"{best_t / t_default:.2f} | {differ} of {len(times) - 1} |"
        )
        print(lines[-1], flush=True)
        write()

    ctx = a.context

    def decode_case(b: int) -> None:
        k_pool, v_pool, perm = pool(b * ctx, gen)
        table = perm.view(b, ctx)
        rows = torch.arange(b, device="cuda", dtype=torch.int32)
        lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(b, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.empty_like(q)
        ctr = torch.zeros(b * HKV, device="cuda", dtype=torch.int32)
        launch = attention.decode_settings(b, HKV)
        t_default = unrolled_graph_time(
            lambda: attention.decode_attention(
                q, k_pool, v_pool, table, rows, lens, scale, out=out, counters=ctr, **launch
            ),  # fmt: skip
            a.reps,
        )
        # the rotary + K/V store launch of the deterministic step (the default fuses it into attention)
        kn = torch.randn(b, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        vn = torch.randn(b, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        pos = lens - 1
        cos = torch.randn(a.max_ctx, D // 2, device="cuda", dtype=torch.float32, generator=gen)
        sin = torch.randn(a.max_ctx, D // 2, device="cuda", dtype=torch.float32, generator=gen)
        slots = torch.full((b,), b * ctx, device="cuda", dtype=torch.int32)  # the spare slot
        qr = q.clone()
        t_rope = unrolled_graph_time(
            lambda: rope.rope_store_kv_(qr, kn, vn, pos, cos, sin, k_pool, v_pool, slots), a.reps
        )
        lines.append(f"| batch {b}: rotary + K/V store launch (deterministic only) | | {t_rope * 1e6:.1f} us | | | | |")

        def run(st):
            st = dict(st or {})
            programs = st.pop("programs", None)
            return invariant.decode_attention(q, k_pool, v_pool, table, rows, lens, scale, a.max_ctx, out=out,
                                              counters=ctr, programs=programs, settings=st)  # fmt: skip

        sweep(f"decode, batch {b}, context {ctx}", t_default, run, decode_candidates())

    for b in a.batches:
        if time.time() - t0 > a.time_limit:
            break
        decode_case(b)
    if a.prefill and time.time() - t0 < a.time_limit:
        n = a.prefill
        k_pool, v_pool, perm = pool(n, gen)
        table = perm.view(1, n)
        one = torch.zeros(1, device="cuda", dtype=torch.int32)
        qlen = torch.full((1,), n, device="cuda", dtype=torch.int32)
        q = torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.empty_like(q)
        t_default = unrolled_graph_time(
            lambda: attention.prefill_attention(q, k_pool, v_pool, table, one, one, qlen, qlen, n, scale, out=out), 3
        )

        def run_p(st):
            return invariant.prefill_attention(q, k_pool, v_pool, table, one, one, qlen, qlen, n, scale, out=out,
                                               settings=st)  # fmt: skip

        reps, a.reps = a.reps, 3
        sweep(f"prefill, one prompt of {n}", t_default, run_p, prefill_candidates())
        a.reps = reps
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
