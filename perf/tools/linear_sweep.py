"""The decode step's projections at small batch on the GPU: cuBLAS (F.linear) against `kernels.linear.skinny_linear`
over a grid of launch settings (K split in parts too: --splits), for the Llama-3.1-8B shapes or
random:qwen3-next-layout's (--shapes next_in next_out ...), each timed in a CUDA graph of 32 launches over 32
distinct weights (as the 32 layers run, so L2 holds none of them), against the weight bytes at the copy bandwidth
measured in the same run. --prologue silu|norm: the input is computed first (an MLP's silu(gate) * up, or add +
RMSNorm); cuBLAS is timed after the prologue's own launch, and each skinny setting
both after that launch and with the prologue fused (--prefetch 0 1: without and with its input loaded a step
ahead; --norm-tile: the fused norm's sum of squares in tiles of that many columns, 0 for block_k).

    python perf/kernels.py linear [--rows 1 2 4 8] [--prologue norm --prefetch 0 1] [--out FILE.md] [--json FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from perf.tools.engine_bench import print_report  # noqa: E402
from perf.tools.timing import copy_bandwidth  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          # random:qwen3-next-layout's (hidden 2,048): a linear layer's in_proj (q, k, v, z, b, a) and out_proj, a
          # full layer's qkv (q with its gate) and o, the MLP's gate_up and down
          "next_in": (12352, 2048), "next_out": (2048, 4096), "next_qkv": (9216, 2048), "next_o": (2048, 4096),
          "next_gate_up": (11264, 2048), "next_down": (2048, 5632)}  # fmt: skip
LAYERS = 32


def prologue_inputs(kind: str, M: int, K: int):
    """(x, the launch that computes the input from x, skinny_linear's inputs for the prologue fused, a reset) for a
    prologue kind; the unfused norm updates a residual of its own in place (the fused one reads `res` and leaves it
    as it was), which the reset puts back before a result is checked."""
    from kernels.act import silu_mul
    from kernels.norm import add_rms_norm

    dt = torch.bfloat16
    x = torch.randn(M, 2 * K if kind == "silu" else K, device="cuda", dtype=dt)
    if kind == "none":
        return x, lambda: x, {}, lambda: None
    if kind == "silu":
        return x, lambda: silu_mul(x), {}, lambda: None
    res, nw = torch.randn(M, K, device="cuda", dtype=dt), torch.randn(K, device="cuda", dtype=dt) * 0.1
    scratch = res.clone()
    fused = dict(norm=(res, nw, 1e-6, torch.empty_like(x)))
    return x, lambda: add_rms_norm(x, scratch, nw, 1e-6, offset=True), fused, lambda: scratch.copy_(res)


def reference(kind: str, x: torch.Tensor, fused: dict, w: torch.Tensor) -> torch.Tensor:
    """The product of w with the prologue's input, from fresh copies (float32)."""
    from kernels import linear

    if kind == "none":
        return F.linear(x.float(), w.float())
    norm = None if "norm" not in fused else (fused["norm"][0].clone(), *fused["norm"][1:3])
    return linear.prologue_linear(kind, x, w, None, norm).float()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--block-k", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--splits", type=int, nargs="+", default=[1], help="K split in this many parts (1: none)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--top", type=int, default=3, help="print this many fastest settings per matrix and row count")
    ap.add_argument("--prologue", choices=("none", "silu", "norm"), default="none",
                    help="what the input is computed from (see above)")  # fmt: skip
    ap.add_argument("--prefetch", type=int, nargs="+", choices=(0, 1), default=[0, 1],
                    help="a prologue fused on tensor cores: its input loaded a step ahead (1) or not (0)")  # fmt: skip
    ap.add_argument("--norm-tile", type=int, nargs="+", default=[0],
                    help="the fused norm's sum-of-squares tile widths to try (0: block_k)")  # fmt: skip
    ap.add_argument("--time-limit", type=float, default=540.0,
                    help="seconds: past this nothing more is timed; what was measured is written")  # fmt: skip
    a = ap.parse_args(argv)
    if a.time_limit <= 0 or a.top < 1:
        ap.error("--time-limit must be above 0 and --top at least 1")
    start = time.perf_counter()
    cut = []
    from kernels import linear
    from kernels.linear import graph_time

    bw = copy_bandwidth()
    pro = a.prologue
    lines = [f"# Small-batch projections: cuBLAS against skinny_linear ({torch.cuda.get_device_name()})", "",
             f"Command: `python perf/kernels.py linear {' '.join(sys.argv[1:])}`  ",
             f"Copy bandwidth measured in this run: {bw / 1e12:.2f} TB/s. µs per launch (a graph of {LAYERS} "
             "launches over distinct weights, divided by 32); fraction = weight bytes / time / copy bandwidth."
             + ("" if pro == "none" else f" Prologue {pro}: cuBLAS timed after its own launch; a setting "
                "with the prologue's flag has it fused, one without runs after that launch."), "",
             "| matrix | N×K | rows | cuBLAS µs (fraction) | skinny best µs (fraction) | settings |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    res = {"bandwidth_TBps": bw / 1e12, "results": []}
    for name in a.shapes:
        N, K = SHAPES[name]
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.01 for _ in range(LAYERS)]
        nbytes = N * K * 2
        for M in a.rows:
            if time.perf_counter() - start > a.time_limit:
                cut.append(f"{name} at {M} rows")
                continue
            x, pre, fused, reset = prologue_inputs(pro, M, K)
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            t0 = time.perf_counter()
            t_cublas = graph_time(lambda pre=pre, ws=ws: [F.linear(pre(), w) for w in ws]) / LAYERS
            ref = reference(pro, x, fused, ws[0])
            best = None
            timed = []
            modes = [False, True] if M == 1 else [True]
            grid = itertools.product(modes, a.block_n, a.block_k, a.warps, a.stages, a.splits)
            variants = [(False, 0, 0)]  # (fused, prefetch, norm_tile)
            if pro != "none":
                variants += [(True, p, t) for p in a.prefetch for t in (a.norm_tile if p and pro == "norm" else [0])]
            for (dot, bn, bk, nw, ns, sp), (fuse, ahead, tile) in itertools.product(grid, variants):
                if K % (bk * sp) or (tile and K % tile) or (ahead and not dot):
                    continue
                if time.perf_counter() - start > a.time_limit:
                    cut.append(f"part of {name}'s settings at {M} rows")
                    break
                s = dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, dot=dot)
                if sp > 1:
                    s["splits"] = sp
                if fuse:
                    s[linear.PROLOGUE_FLAGS[pro]] = True
                    s.update(dict(prefetch=True) if ahead else {}, **(dict(norm_tile=tile) if tile else {}))

                kw, inputs, src = dict(s, out=out), (fused if fuse else {}), ((lambda x=x: x) if fuse else pre)

                def launch(w, kw=kw, inputs=inputs, src=src):  # fused: x as it is; else the prologue's launch first
                    return linear._skinny(src(), w, kw, **inputs)

                try:
                    reset()
                    launch(ws[0])
                    err = (out.float() - ref).abs().max().item()
                    t = graph_time(lambda launch=launch, ws=ws: [launch(w) for w in ws]) / LAYERS
                except Exception as e:  # e.g. out of shared memory: reported, not fatal
                    print(f"{name} M={M} {s}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                    continue
                if err > 0.05 * ref.abs().max().item():
                    print(f"{name} M={M} {s}: WRONG, max error {err:.3g}", flush=True)
                    continue
                timed.append((t, s))
                if best is None or t < best[0]:
                    best = (t, s)
            if best is None:
                print(f"{name} M={M}: no skinny setting ran", flush=True)
                continue
            fc = nbytes / t_cublas / bw
            fs = nbytes / best[0] / bw
            print(f"{name} M={M}: cuBLAS {t_cublas * 1e6:.1f} us ({fc:.2f}), skinny {best[0] * 1e6:.1f} us ({fs:.2f}) "
                  f"{best[1]} [{time.perf_counter() - t0:.0f} s]", flush=True)  # fmt: skip
            for t, s in sorted(timed, key=lambda ts: ts[0])[1 : a.top]:
                print(f"    then {t * 1e6:.1f} us {s}", flush=True)
            res["results"].append({"matrix": name, "N": N, "K": K, "rows": M, "cublas_us": t_cublas * 1e6,
                                   "skinny_us": best[0] * 1e6, "settings": best[1],
                                   "all": [{"us": t * 1e6, "settings": s} for t, s in timed]})  # fmt: skip
            lines.append(f"| {name} | {N}×{K} | {M} | {t_cublas * 1e6:.1f} ({fc:.2f}) | {best[0] * 1e6:.1f} ({fs:.2f}) "
                         f"| {best[1]} |")  # fmt: skip
        ws = None
        torch.cuda.empty_cache()
    if cut:
        lines += ["", f"TIME LIMIT ({a.time_limit:.0f} s): not measured: {', '.join(cut)}"]
    return print_report(lines, res, a.out, a.json)


if __name__ == "__main__":
    sys.exit(main())
