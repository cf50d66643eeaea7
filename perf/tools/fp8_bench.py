"""FP8 weights (backends/common/model/fp8.py, kernels/fp8.py) on one GPU, every ratio from one run:

- matmul: our W8A8 launch (activations quantized inside it) against cuBLAS FP8 (`torch._scaled_mm`, row-wise
  scales, activations quantized beforehand and not timed) and the bf16 cuBLAS product, on a model's projection
  shapes at 1, 32, 128 and 8,192 rows;
- decode: each model's step at batch 1, 32 and 128 (context 1,024) against its roofline (every byte it reads:
  weights at one byte plus their scales, K/V, over the measured copy bandwidth) and against the 16-bit model;
- prefill: 8,192 tokens of each model, FP8 tokens/s over 16-bit tokens/s.

    python perf/engine.py fp8 [--models random:llama3.1-8b-fp8 random:qwen3.5-9b-fp8] [--out FILE.md]

Each `-fp8` model is measured beside the same shape without the suffix (16-bit, bf16), one model on the card at a
time. `--cpu` runs the matmul section on tiny shapes in Triton's interpreter: a smoke run only."""

from __future__ import annotations

import argparse
import gc
import os
import sys

if "--cpu" in sys.argv:  # Triton's interpreter must be on before triton is first imported (perf.tools.timing)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from perf.tools.limits import bounded_report, finish, needs_cuda  # noqa: E402
from perf.tools.timing import copy_bandwidth, cuda_median, wall_median  # noqa: E402


def scaled_mm(x8, sx, w8, sw, out_dtype):
    """cuBLAS FP8 with row-wise scales: x8 [M, K] e4m3 with sx [M, 1], w8 [N, K] with sw [1, N]."""
    return torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=out_dtype)


def rowwise(t):
    """(e4m3, float32 [rows, 1] scales) of t per row: what `_scaled_mm`'s row-wise mode takes."""
    s = t.float().abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
    return (t.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn), s


def matmul_rows(cfg, rows: list[int], reps: int, device: str, timed) -> list[dict]:
    from backends.common.model import fp8
    from kernels import fp8 as k

    q, kv, h, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    shapes = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * f, h), "down": (h, f)}
    out = []
    for name, (N, K) in shapes.items():
        w16 = (torch.randn(N, K, device=device) * 0.02).to(torch.bfloat16 if device == "cuda" else torch.float32)
        w = fp8.quantize(w16)
        w8, sw = rowwise(w16)
        for M in rows:
            x = torch.randn(M, K, device=device).to(w16.dtype)
            row = dict(proj=name, N=N, K=K, M=M, ours=timed(lambda x=x, w=w: k.w8a8(x, w.q, w.scale, w.group), reps))
            row["bf16"] = timed(lambda x=x, w16=w16: torch.nn.functional.linear(x, w16), reps)
            row["cublas_fp8"] = None
            if device == "cuda":
                x8, sx = rowwise(x)
                try:
                    row["cublas_fp8"] = timed(lambda a=(x8, sx, w8, sw.t(), x.dtype): scaled_mm(*a), reps)
                except RuntimeError as e:  # a shape cuBLAS FP8 refuses: reported as such
                    row["cublas_error"] = str(e).splitlines()[0][:80]
            out.append(row)
    return out


def nbytes(t) -> int:
    from backends.common.model import fp8

    if isinstance(t, fp8.Fp8Weight):
        return t.nbytes()
    if isinstance(t, fp8.RowParts):
        return sum(nbytes(p) for p in t.parts)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def step_bytes(runner, B: int, ctx: int) -> int:
    """Bytes a decode step of B sequences at context ctx reads: every weight of the main model once (FP8 ones with
    their scales; of the embedding table only B rows; of an MoE layer's routed experts the expected number B
    tokens touch under uniform routing, E x (1 - (1 - K / E)^B)), and the K/V of B x ctx positions."""
    cfg = runner.cfg
    if runner.hybrid is not None:
        h = runner.hybrid
        shared_views = {n for n in h.w if "shared_expert." in n} if h.fold_shared else set()
        total = sum(nbytes(t) for n, t in h.w.items()
                    if not n.startswith("mtp.") and n not in shared_views
                    and (n != "model.embed_tokens.weight" or cfg.tie_word_embeddings))  # fmt: skip
        E, K = cfg.num_experts, cfg.num_experts_per_tok
        for key, (gate_up, down) in h.experts.items():
            if key != "mtp":
                per_expert = (nbytes(gate_up) + nbytes(down)) / gate_up.shape[0]
                total += round(E * (1 - (1 - K / E) ** B) * per_expert)
    else:  # GpuLlama: its fused projections per layer, the LM head and the final norm
        m = runner.model
        total = sum(nbytes(t) for L in m.layers for t in L.values() if t is not None)
        total += nbytes(m.lm_head) + nbytes(m.final_norm)
    kv = runner.kv
    per_pos = sum(kv.k(i)[0].numel() + kv.v(i)[0].numel() for i in range(kv.num_layers)) * kv.k(0).element_size()
    return int(total + B * ctx * per_pos)


def decode_and_prefill(spec: str, batches: list[int], ctx: int, reps: int, bw: float) -> dict:
    from backends.common.engine.runner import ModelRunner
    from backends.common.model.batch import Span

    runner = ModelRunner(spec, "bfloat16", "cuda", kv_tokens=max(batches) * (ctx + 8) + 8192, max_batch=max(batches),
                         graph_sizes=tuple(batches))  # fmt: skip
    if runner.state is not None:
        runner.kv.buffer.normal_(0, 0.5)
        runner.state.buffer.normal_(0, 0.05)
    res = {"model": spec, "quantization": runner.quantization, "decode": {}}
    for B in batches:
        spans = [Span([7 + i], ctx, list(range(i * (ctx + 8), i * (ctx + 8) + ctx + 1)), f"b{B}-{i}",
                      i if runner.state is not None else -1) for i in range(B)]  # fmt: skip
        runner.forward(spans)
        graphs = getattr(runner.model, "graphs", None)
        if graphs and runner.model.fits_graph(B):
            t = cuda_median(graphs[runner.model.graph_size(B)].replay, reps)
        else:
            t = cuda_median(lambda s=spans, f=runner.forward: f(s), reps)
        res["decode"][B] = dict(step=t, roofline=step_bytes(runner, B, ctx + 1) / bw, graphed=bool(graphs))
        if hasattr(runner.model, "forget"):  # the graph path's slot-table rows
            for s in spans:
                runner.model.forget(s.key)
    n = 8192
    prompt = torch.randint(0, runner.cfg.vocab_size, (n,)).tolist()
    span = [Span(prompt, 0, list(range(n)), "prefill", 0 if runner.state is not None else -1)]
    if runner.state is not None:
        runner.apply_state_ops([(0, -1)])
    res["prefill_tokens_s"] = n / cuda_median(lambda f=runner.forward: f(span), 3, warmup=1)
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["random:llama3.1-8b-fp8", "random:qwen3.5-9b-fp8"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128, 8192], help="matmul rows")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cpu", action="store_true", help="the matmul section on tiny shapes, interpreted: a smoke run")
    ap.add_argument("--time-limit", type=float, default=540, help="wall-clock bound; what was measured is written")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not a.cpu and needs_cuda("fp8_bench"):
        return 2
    from backends.common.core.config import SHAPES

    where = "CPU (Triton's interpreter)" if a.cpu else torch.cuda.get_device_name()
    rows: list[dict] = []
    lines = [f"# FP8 weights on {where}", "", f"Command: `python perf/engine.py fp8 "
             f"{' '.join(sys.argv[1:] if argv is None else argv)}`", ""]  # fmt: skip
    write, timer = bounded_report(lines, a.out, rows, a.time_limit)
    device = "cpu" if a.cpu else "cuda"
    timed = (lambda fn, r: wall_median(fn, 2)) if a.cpu else (lambda fn, r: cuda_median(fn, r))
    first = a.models[0].removeprefix("random:")
    cfg = SHAPES["tiny-test"] if a.cpu else SHAPES[first]
    lines += [
        f"## Matmul: `{cfg.hidden_size}`-wide projections of {'tiny-test' if a.cpu else first}",
        "",
        "| projection | N x K | rows | ours (W8A8) | cuBLAS FP8 | ours / cuBLAS FP8 | bf16 cuBLAS | bf16 / ours |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in matmul_rows(cfg, [m for m in a.rows if not a.cpu or m <= 128], a.reps, device, timed):
        rows.append({"section": "matmul", **r})
        fp8c = r["cublas_fp8"]
        lines.append(
            f"| {r['proj']} | {r['N']} x {r['K']} | {r['M']} | {r['ours'] * 1e6:.1f} us | "
            + (
                f"{fp8c * 1e6:.1f} us | **{r['ours'] / fp8c:.2f}x** |"
                if fp8c
                else f"{r.get('cublas_error', '-')} | - |"
            )
            + f" {r['bf16'] * 1e6:.1f} us | {r['bf16'] / r['ours']:.2f}x |"
        )
        write()
    if a.cpu:
        return finish(timer, lines, write)
    bw = copy_bandwidth()
    lines += ["", f"## Decode step and prefill (copy bandwidth {bw / 1e9:.0f} GB/s, context {a.context})", "",
              "| model | batch | step | roofline | step / roofline | 16-bit step | 16-bit / FP8 | graphs |",
              "|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for spec in a.models:
        base = spec.removesuffix("-fp8")
        got = {m: decode_and_prefill(m, a.batches, a.context, a.reps, bw) for m in (spec, base)}
        rows.append({"section": "model", **{k: v for k, v in got.items()}})
        for B in a.batches:
            f8, bf = got[spec]["decode"][B], got[base]["decode"][B]
            lines.append(
                f"| {spec} | {B} | {f8['step'] * 1e3:.3f} ms | {f8['roofline'] * 1e3:.3f} ms | "
                f"**{f8['step'] / f8['roofline']:.2f}x** | {bf['step'] * 1e3:.3f} ms | "
                f"**{bf['step'] / f8['step']:.2f}x** | {'yes' if f8['graphed'] else 'eager'} |"
            )
        p8, p16 = got[spec]["prefill_tokens_s"], got[base]["prefill_tokens_s"]
        lines.append(f"| {spec} prefill 8,192 | | {p8:,.0f} tok/s | | | {p16:,.0f} tok/s | **{p8 / p16:.2f}x** | |")
        write()
    return finish(timer, lines, write)


if __name__ == "__main__":
    sys.exit(main())
