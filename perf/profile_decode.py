"""Where a decode step's time goes, on the GPU: per-kernel time of one step (torch.profiler over the eager body of
the captured graph, the same kernels), the host's share of a whole step, and how each projection of the small
decode graphs runs (cuBLAS or skinny_linear, as timed and chosen at graph capture).

    python perf/profile_decode.py [--model random:llama3.1-8b] [--batches 1 64] [--context 1024] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.engine_bench import cuda_time, kv_bytes_read, measure_bandwidth, weight_bytes_read  # noqa: E402


def kernel_breakdown(fn, reps: int = 10) -> list[tuple[str, float, int]]:
    """(kernel name, µs per step, launches per step), largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    agg: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        dt = ev.time_range.elapsed_us()
        a = agg[ev.name[:90]]
        a[0] += dt / reps
        a[1] += 1 / reps
    return sorted(((k, v[0], round(v[1])) for k, v in agg.items()), key=lambda r: -r[1])


def host_split(runner, spans, reps: int = 30) -> dict:
    """A whole engine step (host inputs, graph with its argmax, tokens back) against the graph alone, and the host's
    share of it, each phase timed from an idle GPU: filling the inputs and launching the graph, and reading the
    tokens once the GPU is done."""
    from perf.engine_bench import engine_step

    m = runner.model
    bs = m.graph_size(len(spans))
    t_graph = cuda_time(m.graphs[bs].replay, reps)
    for _ in range(3):
        engine_step(runner, spans)
    t0 = time.perf_counter()
    for _ in range(reps):
        engine_step(runner, spans)
    t_step = (time.perf_counter() - t0) / reps
    launch, tail = 0.0, 0.0
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        handle = m.launch_greedy(spans)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        m.collect(handle)
        t3 = time.perf_counter()
        launch, tail = launch + t1 - t0, tail + t3 - t2
    return {"graph_ms": t_graph * 1e3, "step_ms": t_step * 1e3, "launch_ms": launch / reps * 1e3,
            "tail_ms": tail / reps * 1e3}  # fmt: skip


@torch.inference_mode()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama3.1-8b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--kv-tokens", type=int, default=140_000)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    from backends.common.engine.runner import ModelRunner
    from backends.common.model.batch import Span

    bw = measure_bandwidth()
    L = [f"# Decode step profile ({torch.cuda.get_device_name()}, {a.model}, bf16, context {a.context})", ""]
    L.append(f"Copy bandwidth measured in this run: {bw / 1e12:.2f} TB/s.")
    runner = ModelRunner(a.model, "bfloat16", "cuda", a.kv_tokens, max_batch=max(a.batches))
    cfg = runner.cfg
    for b in a.batches:
        ctx = a.context
        spans = [Span([1], ctx, list(range(i * (ctx + 1), (i + 1) * (ctx + 1))), f"p{b}-{i}") for i in range(b)]
        for _ in range(3):  # the graph's inputs hold this batch before the graph is timed alone
            runner.forward(spans)
        split = host_split(runner, spans)
        roof = (weight_bytes_read(cfg, 2) + kv_bytes_read(cfg, b, ctx + 1, 2)) / bw * 1e3
        L += ["", f"## Batch {b}", ""]
        L.append(
            f"roofline {roof:.3f} ms; graph {split['graph_ms']:.3f} ms ({split['graph_ms'] / roof:.2f}×); "
            f"whole step {split['step_ms']:.3f} ms ({split['step_ms'] / roof:.2f}×). Host, from an idle GPU: "
            f"inputs + graph launch {split['launch_ms']:.3f} ms, tokens back {split['tail_ms']:.3f} ms"
        )
        m = runner.model
        bs = m.graph_size(b)
        rows = kernel_breakdown(partial(m._decode_body, bs))
        total = sum(r[1] for r in rows)
        L += ["", f"Kernels of one step, eager (sum {total / 1e3:.3f} ms):", "", "| kernel | µs/step | launches |"]
        L.append("|---|---|---|")
        L += [f"| `{k}` | {us:.1f} | {n} |" for k, us, n in rows[:25]]
        print("\n".join(L), flush=True)
        for i in range(b):
            runner.forget(f"p{b}-{i}")
    L += ["", "## Projections of the small decode graphs: cuBLAS or skinny_linear", ""]
    L.append("Timed at graph capture (kernels.linear.tune): µs per layer, a CUDA graph over the 32 layers' weights; "
             "the chosen one in bold.")  # fmt: skip
    L += ["", "| projection | graph batch | cuBLAS µs | best skinny_linear µs | chosen |", "|---|---|---|---|---|"]
    m = runner.model
    for (name, bs), times in sorted(m.linear_times.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if not times:
            continue
        sk = min((t for k, t in times.items() if k != "cublas" and isinstance(t, float)), default=None)
        pick = m.linear_choice.get((name, bs))
        skc = f"{sk * 1e6:.1f}" if sk is not None else "-"
        L.append(f"| {name} | {bs} | {times['cublas'] * 1e6:.1f} | {skc} | {'skinny' if pick else 'cuBLAS'} |")
    text = "\n".join(L) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
