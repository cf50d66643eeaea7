"""The gated delta rule kernels on a GPU against the memory roofline of the state they read and write.

Decode: one step of one linear-attention layer for B requests reads and writes each request's recurrent state
(value heads x key dim x value dim float32) once; the bound is those bytes at the device's copy bandwidth, which
this run measures itself (a device-to-device copy of the same bytes), next to the PyTorch path (gather the pages,
step, scatter back). Prefill: the varlen chunked kernel against the PyTorch chunked form on the same tokens;
`--scan-sweep` also times the chunked kernel's launch settings (kernels.delta_rule.SCAN), each in a process of its
own (a setting that faults is listed, not fatal), and the PyTorch chunk algebra alone (chunk_prep), on the last
`--prefill` size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from perf.tools.limits import finish, needs_cuda, report_writer, wall_clock_limit
from perf.tools.timing import cuda_median


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=32, help="value heads (Qwen3-Next: 32)")
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--prefill", type=int, nargs="+", default=[512, 2048, 8192], help="prefill tokens in all")
    ap.add_argument("--sequences", type=int, default=4, help="prefill: the tokens split evenly over this many")
    ap.add_argument("--scan-sweep", action="store_true", help="time kernels.delta_rule.SCAN settings too")
    ap.add_argument("--one-setting", default=None, help=argparse.SUPPRESS)  # the sweep's child: one SCAN setting
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--time-limit", type=float, default=300)
    ap.add_argument("--out", default=None, help="markdown file for the results (also printed), plus .json beside it")
    a = ap.parse_args(argv)
    if needs_cuda("delta_rule_roofline"):
        return 2
    from backends.common.model import delta_rule as dr
    from kernels import delta_rule as kd

    if a.one_setting is not None:
        return _one_setting(a, json.loads(a.one_setting))
    rows: list[dict] = []
    lines = [
        f"# Gated delta rule kernels on {torch.cuda.get_device_name()}",
        "",
        f"Per linear-attention layer: {a.heads} value heads, state {a.dk} x {a.dv} float32 "
        f"({a.heads * a.dk * a.dv * 4 / 2**20:.1f} MiB per request). Command: `python perf/kernels.py delta-rule`.",
        "",
    ]

    write = report_writer(lines, a.out, rows)

    timer = wall_clock_limit(a.time_limit, write, [])
    dev = "cuda"
    H, DK, DV = a.heads, a.dk, a.dv
    gen = torch.Generator(device=dev).manual_seed(0)

    def qkv(T):
        q = dr.l2norm(torch.randn(T, H, DK, device=dev, generator=gen)) * DK**-0.5
        k = dr.l2norm(torch.randn(T, H, DK, device=dev, generator=gen))
        v = torch.randn(T, H, DV, device=dev, generator=gen)
        g = -torch.rand(T, H, device=dev, generator=gen) * 0.1
        beta = torch.rand(T, H, device=dev, generator=gen)
        return q, k, v, g, beta

    lines += [
        "## Decode step (one layer)",
        "",
        "| batch | state bytes r+w | copy of the same bytes (measured) | kernel | kernel GB/s | of copy bw | "
        "PyTorch gather/step/scatter | speed-up |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for B in a.batches:
        P = 2 * B + 8
        state = torch.randn(P, H, DK, DV, device=dev, generator=gen) * 0.01
        pages = torch.randperm(P, device=dev, generator=gen)[:B]
        q, k, v, g, beta = qkv(B)
        nbytes = 2 * B * H * DK * DV * 4
        src = torch.empty(nbytes // 8, device=dev, dtype=torch.float32)
        dst = torch.empty_like(src)
        t_copy = cuda_median(lambda: dst.copy_(src), a.reps)  # reads and writes nbytes / 2 each: nbytes in all
        t_kernel = cuda_median(lambda: kd.recurrent_step(q, k, v, g, beta, state, pages), a.reps)

        def torch_step():
            s = state[pages]
            dr.recurrent_step(q, k, v, g, beta, s)
            state[pages] = s

        t_torch = cuda_median(torch_step, a.reps)
        gbs, copy_gbs = nbytes / t_kernel / 1e9, nbytes / t_copy / 1e9
        rows.append(dict(kind="decode", batch=B, bytes=nbytes, copy_s=t_copy, kernel_s=t_kernel, torch_s=t_torch))
        lines.append(
            f"| {B} | {nbytes / 2**20:.1f} MiB | {t_copy * 1e6:.1f} us ({copy_gbs:.0f} GB/s) | {t_kernel * 1e6:.1f} us "
            f"| {gbs:.0f} | {gbs / copy_gbs:.2f} | {t_torch * 1e6:.1f} us | {t_torch / t_kernel:.1f}x |"
        )
    lines += [
        "",
        f"## Prefill ({a.sequences} sequences, varlen, one layer)",
        "",
        "| tokens | kernel | tokens/s | PyTorch chunked (per sequence) | speed-up | max abs diff |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    N = a.sequences
    for T in a.prefill:
        lens = [T // N] * N
        starts = [sum(lens[:i]) for i in range(N)]
        q, k, v, g, beta = qkv(T)
        state = torch.zeros(N + 4, H, DK, DV, device=dev)
        ints = lambda xs: torch.tensor(xs, device=dev)  # noqa: E731
        pg, st, ln = ints(list(range(N))), starts, lens

        def kernel():
            state[:N].zero_()
            return kd.chunked(q, k, v, g, beta, state, pg, st, ln)

        def reference():
            out = []
            for i in range(N):
                sl = slice(starts[i], starts[i] + lens[i])
                s = torch.zeros(H, DK, DV, device=dev)
                out.append(dr.chunked(q[sl], k[sl], v[sl], g[sl], beta[sl], s))
            return torch.cat(out)

        t_kernel = cuda_median(kernel, max(5, a.reps // 5))
        t_ref = cuda_median(reference, max(5, a.reps // 5))
        diff = (kernel() - reference()).abs().max().item()
        rows.append(dict(kind="prefill", tokens=T, kernel_s=t_kernel, torch_s=t_ref, max_abs_diff=diff))
        lines.append(
            f"| {T} | {t_kernel * 1e3:.2f} ms | {T / t_kernel:,.0f} | {t_ref * 1e3:.2f} ms | "
            f"{t_ref / t_kernel:.1f}x | {diff:.1e} |"
        )
    if a.scan_sweep:
        lines += [
            "",
            f"## Chunked prefill launch settings ({T} tokens, {N} sequences; kernels.delta_rule.SCAN)",
            "",
            "| state bv | warps | out bv | out warps | precision | whole call | max abs diff vs PyTorch |",
            "|---:|---:|---:|---:|---|---:|---:|",
        ]
        settings = [
            dict(bv=bv, warps=warps, out_bv=obv, out_warps=owarps, precision=prec)
            for prec in ("tf32x3", "tf32")
            for bv in (16, 32, 64)
            for warps in (4, 8)
            for obv, owarps in ((64, 4), (128, 8))
        ] + [dict(prep_warps=pw) for pw in (4, 16)]
        for setting in settings:  # each in a process of its own: a setting that faults cannot end the sweep
            res = _run_setting(a, T, N, setting)
            full = {**kd.SCAN, **setting}
            cells = " | ".join(str(full[k]) for k in ("bv", "warps", "out_bv", "out_warps", "precision"))
            if "error" in res:
                lines.append(f"| {cells} | {res['error']} | |")
            else:
                rows.append(dict(kind="scan", **full, s=res["s"], max_abs_diff=res["max_abs_diff"]))
                note = f" (chunk algebra in {setting['prep_warps']} warps)" if "prep_warps" in setting else ""
                lines.append(f"| {cells} | {res['s'] * 1e3:.2f} ms{note} | {res['max_abs_diff']:.1e} |")
            write()
        from backends.common.model.delta_rule import chunk_prep

        t = cuda_median(lambda: chunk_prep(q, k, v, g, beta, kd.CHUNK), 5)
        lines += ["", f"chunk_prep alone (the PyTorch chunk algebra, one sequence of {T}): {t * 1e3:.2f} ms"]
    return finish(timer, lines, write)


def _run_setting(a, T: int, N: int, setting: dict) -> dict:
    """Time one chunked-prefill setting in a child process; {'s', 'max_abs_diff'} or {'error'}."""
    cmd = [sys.executable, "-m", "perf.tools.delta_rule_roofline", "--heads", str(a.heads), "--dk", str(a.dk), "--dv",
           str(a.dv), "--prefill", str(T), "--sequences", str(N), "--one-setting", json.dumps(setting)]  # fmt: skip
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return {"error": "timed out (120 s)"}
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit {out.returncode}: " + tail[:80].replace("|", "/")}


def _one_setting(a, setting: dict) -> int:
    from backends.common.model import delta_rule as dr
    from kernels import delta_rule as kd

    kd.SCAN.update(setting)
    dev, T, N = "cuda", a.prefill[-1], a.sequences
    H, DK, DV = a.heads, a.dk, a.dv
    gen = torch.Generator(device=dev).manual_seed(0)
    q = dr.l2norm(torch.randn(T, H, DK, device=dev, generator=gen)) * DK**-0.5
    k = dr.l2norm(torch.randn(T, H, DK, device=dev, generator=gen))
    v = torch.randn(T, H, DV, device=dev, generator=gen)
    g = -torch.rand(T, H, device=dev, generator=gen) * 0.1
    beta = torch.rand(T, H, device=dev, generator=gen)
    lens = [T // N] * N
    starts = [sum(lens[:i]) for i in range(N)]
    state = torch.zeros(N, H, DK, DV, device=dev)
    pages = torch.arange(N, device=dev)

    def kernel():
        state.zero_()
        return kd.chunked(q, k, v, g, beta, state, pages, starts, lens)

    ref = torch.cat([
        dr.chunked(q[s0 : s0 + n], k[s0 : s0 + n], v[s0 : s0 + n], g[s0 : s0 + n], beta[s0 : s0 + n],
                   torch.zeros(H, DK, DV, device=dev))
        for s0, n in zip(starts, lens)
    ])  # fmt: skip
    t = cuda_median(kernel, 5)
    print("RESULT " + json.dumps({"s": t, "max_abs_diff": (kernel() - ref).abs().max().item()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
