"""The hybrid (Qwen3-Next / Qwen3.5 layout) model on a GPU: the decode step in CUDA graphs against its memory
roofline, the eager path on the same batch, and the prefill of one long prompt against a bf16 matmul's rate, all
measured in the same run.

    python perf/engine.py hybrid [--models random:qwen3-next-layout random:qwen3.5-9b] [--batches 1 32 128]
                                [--context 1024] [--prefill 8192] [--speculative] [--out FILE.md]

Decode roofline of a batch of B sequences of `context` tokens: the weight bytes one step reads (every layer, the
final norm and the LM head; not the embedding table, of which it reads B rows, nor the MTP head; of an MoE layer
the experts a batch of B is expected to route to, `weights_read_per_step`) + the
full-attention layers' K/V of every context token + each sequence's state page read and written, over the
device-to-device copy bandwidth measured here. Only the measured batch sizes are captured in graphs (and tuned at
capture): a batch of B replays the graph of B either way, and a server's other sizes would only make the capture
longer (`--all-graph-sizes` captures them all). `graph` is the GPU time of one replay (CUDA events around each of
`--series` back-to-back series of `--reps` replays; the median series, every series listed below the table);
`loop` is the wall time per step of overlapped greedy steps as the engine and decode run them (step n+1 launched
before step n's tokens are read, ids of -1), host work included. K/V and state are random, not zeros.

Prefill: one prompt in one forward pass (eager path: the projections in cuBLAS, the chunked delta rule in Triton,
full attention in the paged Triton flash kernel), after a warm-up prompt; model FLOPs = 2 x matmul parameters x
tokens + causal attention (4 x T^2 / 2 x heads x head dim per full layer), against an 8192^3 bf16 matmul timed here.
`--profile` also lists the prefill's kernels by GPU time.

`--speculative`: the speculative step's graphs at each batch (every sequence verifies its input token and a draft,
then the MTP head drafts the next), GPU time per replay against the decode step's and the same roofline."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from perf.tools.limits import bounded_report, finish, needs_cuda
from perf.tools.timing import copy_bandwidth, cuda_series, cuda_time, matmul_rate


def weights_read_per_step(runner, batch: int = 1) -> tuple[int, int]:
    """(bytes a decode step of `batch` sequences reads of the weights, matmul parameters one token uses in the
    main model). MoE layers: the router and shared expert always, and of the routed experts the expected number a
    batch touches under uniform routing, E x (1 - (1 - K / E)^batch), each read once (random weights route close
    to uniformly); a token uses K of them."""
    w, cfg = runner.hybrid.w, runner.cfg
    skip = {"model.embed_tokens.weight"} if not cfg.tie_word_embeddings else set()
    names = [n for n in w if n not in skip and not n.startswith("mtp.")]
    nbytes = sum(w[n].numel() * w[n].element_size() for n in names)
    if "lm_head.weight" not in w:
        names.append("model.embed_tokens.weight")  # tied: the LM head reads the embedding table
    params = sum(w[n].numel() for n in names if w[n].dim() == 2)
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    for key, (gate_up, down) in runner.hybrid.experts.items():
        if key == "mtp":
            continue
        per_expert = gate_up[0].numel() + down[0].numel()
        nbytes += round(E * (1 - (1 - K / E) ** batch) * per_expert * gate_up.element_size())
        params += K * per_expert
    return nbytes, params


def randomise(runner) -> None:
    """K/V and state pages filled with small random values (never time on zeros)."""
    runner.kv.buffer.normal_(0, 0.5)
    runner.state.buffer.normal_(0, 0.05)


def decode_rows(runner, B: int, context: int, steps: int, gen) -> list[tuple[list[int], int, object]]:
    """B sequences of `context` tokens with room for `steps` more: (slots, state page, key) each."""
    n = context + steps + 2
    perm = torch.randperm(runner.num_slots, generator=gen)[: B * n].tolist()
    return [(perm[i * n : (i + 1) * n], i, f"b{B}-{i}") for i in range(B)]


def profile_graph(graph, title: str, reps: int = 5, top: int = 14, sequence: int = 0) -> None:
    """Print the kernels of a graph replay by total GPU time (torch.profiler reads graph kernels through CUPTI)."""
    profile_kernels(graph.replay, title, reps, top, sequence)


def profile_kernels(fn, title: str, reps: int = 5, top: int = 14, sequence: int = 0) -> None:
    """Print the kernels `fn` launches by total GPU time per call, and the wall time per call; sequence: also the
    first that many kernels of the last call in launch order, each with its start after the call's first kernel
    and its duration (under programmatic dependent launch a kernel's time includes its wait for the one before)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / reps
    per = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            t, n = per.get(ev.name, (0.0, 0))
            per[ev.name] = (t + ev.device_time, n + 1)
    total = sum(t for t, _ in per.values())
    print(f"\nprofile, {title}: {total / reps / 1e3:.3f} ms of kernels per call ({wall * 1e3:.1f} ms wall, "
          "profiler on)", flush=True)  # fmt: skip
    for name, (t, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {t / reps / 1e3:7.3f} ms  {n // reps:4d}x  {name[:110]}", flush=True)
    try:  # the split by grid is an extra: a trace that cannot be written or read leaves the table above
        with tempfile.TemporaryDirectory() as d:
            prof.export_chrome_trace(str(Path(d) / "trace.json"))
            by_grid = kernels_by_grid(json.loads((Path(d) / "trace.json").read_text()), reps)
    except (OSError, RuntimeError, ValueError, KeyError, TypeError) as e:
        print(f"  (no split by grid: {e!r:.100})", flush=True)
        by_grid = []
    if by_grid:
        print("  kernels launched with more than one grid, by grid (each projection's launches apart):", flush=True)
        for name, grid, ms, n, us in by_grid:
            print(f"  {ms:7.3f} ms  {n:4d}x  {us:6.1f} us each  grid {'x'.join(map(str, grid)):>10}  {name[:70]}",
                  flush=True)  # fmt: skip
    if sequence:
        evs = sorted((ev for ev in prof.events() if ev.device_type.name == "CUDA"), key=lambda ev: ev.time_range.start)
        last = evs[len(evs) - len(evs) // reps :]
        t0 = last[0].time_range.start if last else 0
        print(f"  the last call's first {min(sequence, len(last))} of {len(last)} kernels (start, duration, us):")
        for ev in last[:sequence]:
            print(f"    {ev.time_range.start - t0:9.1f} {ev.device_time:7.1f}  {ev.name[:80]}", flush=True)


def kernels_by_grid(trace: dict, reps: int) -> list[tuple[str, tuple, float, int, float]]:
    """From a torch.profiler Chrome trace of `reps` calls, the kernels launched with more than one grid (e.g.
    skinny_linear, one grid per projection shape) as (name, grid, ms per call, launches per call, us per launch),
    each name's grids by time, names by their total time. Kernels with one grid are in the per-name table already;
    a trace without grids gives []."""
    per: dict[tuple[str, tuple], list[float]] = {}
    for ev in trace.get("traceEvents", []):
        kernel = str(ev.get("cat", "")).lower() == "kernel"  # older kineto writes Kernel
        grid = ev.get("args", {}).get("grid") if kernel else None
        if grid is not None:
            per.setdefault((ev["name"], tuple(grid)), []).append(float(ev.get("dur", 0.0)))
    grids: dict[str, list[tuple]] = {}
    for name, grid in per:
        grids.setdefault(name, []).append(grid)
    total = {name: sum(sum(per[(name, g)]) for g in gs) for name, gs in grids.items() if len(gs) > 1}
    rows = []
    for name in sorted(total, key=lambda n: -total[n]):
        for g in sorted(grids[name], key=lambda g: -sum(per[(name, g)])):
            durs = per[(name, g)]
            rows.append((name, g, sum(durs) / reps / 1e3, len(durs) // reps, sum(durs) / len(durs)))
    return rows


def fastest_where(times: dict, keep) -> float | None:
    """The shortest time among tune's `times` ({description: seconds, or an error}) whose description `keep`
    accepts, or None."""
    return min((v for k, v in times.items() if keep(k) and isinstance(v, float)), default=None)


def time_decode(runner, B: int, a, gen, series: list | None = None) -> tuple[float, float, float | None]:
    """(graph replay, overlapped loop step, eager step or None) seconds for a batch of B sequences. The graph
    replay is the median of `a.series` (1 when absent) back-to-back series of `a.reps` replays, each series' time
    appended to `series` when given."""
    from backends.common.model.batch import Span

    model = runner.model
    seqs = decode_rows(runner, B, a.context, a.reps, gen)

    def spans(k, ids=None):
        return [Span([ids if ids is not None else 7 + i], a.context + k, sl, key, pg)
                for i, (sl, pg, key) in enumerate(seqs)]  # fmt: skip

    runner.forward(spans(0))  # fills the slot table rows, one replay
    times = cuda_series(model.graphs[model.graph_size(B)].replay, a.reps, getattr(a, "series", 1))
    t_graph = statistics.median(times)
    if series is not None:
        series.extend(times)
    torch.cuda.synchronize()
    t = time.perf_counter()
    handle = runner.launch_greedy(spans(0))
    for k in range(1, a.reps + 1):
        nxt = runner.launch_greedy(spans(k, -1))
        runner.collect(handle)
        handle = nxt
    runner.collect(handle)
    t_loop = (time.perf_counter() - t) / (a.reps + 1)
    t_eager = cuda_time(lambda: model._eager(spans(a.reps + 1)), 3) if B in a.eager_batches else None
    if a.profile:
        profile_graph(model.graphs[model.graph_size(B)], f"{runner.cfg.num_layers}-layer model, batch {B}",
                      sequence=a.profile_sequence)  # fmt: skip
    for _, _, key in seqs:
        runner.forget(key)
    return t_graph, t_loop, t_eager


def time_speculative(runner, B: int, a, gen) -> tuple[float, float]:
    """(verification graph replay, verification + MTP head replays) seconds for a batch of B sequences that each
    verify an input token and one draft (`--speculative mtp`'s step)."""
    from backends.common.model.batch import Span

    model = runner.model
    seqs = decode_rows(runner, B, a.context, a.reps, gen)
    spans = [Span([7 + i, 9 + i], a.context, sl, key, pg, logits_all=True, save_page=runner.scratch_page(i))
             for i, (sl, pg, key) in enumerate(seqs)]  # fmt: skip
    if not runner.launch_verify(spans):
        raise SystemExit(f"hybrid_bench: batch {B} does not verify in a graph")
    bs = model.graph_size(B)
    verify = model.verify_graphs[bs].replay
    t_verify = cuda_time(verify, a.reps)
    t_both = cuda_time(lambda: (verify(), model.mtp_graphs[bs].replay()), a.reps) if model.mtp_graphs else None
    for _, _, key in seqs:
        runner.forget(key)
    return t_verify, t_both


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["random:qwen3-next-layout", "random:qwen3.5-9b"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=30, help="graph replays and loop steps timed per batch")
    ap.add_argument("--series", type=int, default=3,
                    help="back-to-back series of --reps graph replays; the graph step is their median, and each "
                         "series' time is printed below the table (the first after the warm-up replay ran slower "
                         "than the next by up to 0.09 ms in perf/results/instep_h100)")  # fmt: skip
    ap.add_argument("--eager-batches", type=int, nargs="*", default=[1, 32], help="also time the eager path")
    ap.add_argument("--prefill", type=int, default=8192, help="prompt tokens of the prefill measurement (0: none)")
    ap.add_argument("--profile", action="store_true",
                    help="print each batch's kernels by GPU time, and a kernel launched with several grids (such as "
                    "skinny_linear, one per projection shape) by grid")  # fmt: skip
    ap.add_argument(
        "--profile-sequence",
        type=int,
        default=0,
        help="with --profile: also this many kernels of a replay in launch order, with their times",
    )
    ap.add_argument("--speculative", action="store_true",
                    help="also time the speculative step's graphs (verify an input and a draft per sequence, then "
                         "the MTP head) against the decode step")  # fmt: skip
    ap.add_argument("--all-graph-sizes", action="store_true",
                    help="capture (and tune) every graph size a server captures up to the largest batch, not only "
                         "the measured batches' (the same graphs for those; capture takes longer)")  # fmt: skip
    ap.add_argument("--time-limit", type=float, default=540)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if needs_cuda("hybrid_bench"):
        return 2
    from backends.common.engine.runner import GRAPH_SIZES, ModelRunner
    from backends.common.model.batch import Span
    from kernels import delta_rule, delta_tune, linear, pdl

    rows: list[dict] = []
    lines = [f"# Hybrid models on {torch.cuda.get_device_name()} (bfloat16, random weights)", ""]
    write, timer = bounded_report(lines, a.out, rows, a.time_limit)
    bw, mm = copy_bandwidth(), matmul_rate()
    lines += [
        f"Measured here: copy bandwidth {bw / 1e9:,.0f} GB/s (read + written), bf16 8192^3 matmul "
        f"{mm / 1e12:,.0f} TFLOP/s. Command: `python perf/engine.py hybrid {' '.join(argv or sys.argv[1:])}`"
        f"{'' if pdl.enabled(torch.device('cuda')) else ', programmatic dependent launch off'}.",
        "",
        "| model | batch | graph step | loop step | roofline | graph / roofline | loop / roofline | eager step "
        "| tokens/s (loop) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    prefill_lines, spec_lines, series_lines = [], [], []
    gen = torch.Generator().manual_seed(0)
    for spec in a.models:
        t0 = time.perf_counter()
        kv_tokens = max(a.batches) * (a.context + a.reps + 2) + a.prefill + 64
        runner = ModelRunner(spec, "bfloat16", "cuda", kv_tokens, max_batch=max(a.batches),
                             state_pages=max(a.batches) + 2,
                             graph_sizes=GRAPH_SIZES if a.all_graph_sizes else tuple(sorted(a.batches)))  # fmt: skip
        t_load = time.perf_counter() - t0
        cfg = runner.cfg
        if runner.backend != "triton":
            raise SystemExit(f"hybrid_bench: {spec} does not run the graph path (backend {runner.backend})")
        if a.speculative:
            runner.prepare_speculative("mtp" if runner.has_mtp else "ngram")
        randomise(runner)
        _, params = weights_read_per_step(runner)
        kv_token = len(cfg.full_layers) * 2 * cfg.num_kv_heads * cfg.head_dim * runner.kv.buffer.element_size()
        state_page = runner.state.bytes_per_page
        name = spec.removeprefix("random:")
        for B in a.batches:
            times: list[float] = []
            t_graph, t_loop, t_eager = time_decode(runner, B, a, gen, times)
            series_lines.append(f"{name} batch {B}: " + " / ".join(f"{t * 1e3:.3f}" for t in times) + " ms")
            w_bytes, _ = weights_read_per_step(runner, B)
            roof = (w_bytes + B * (a.context * kv_token + 2 * state_page)) / bw
            rows.append(dict(model=name, batch=B, graph_s=t_graph, graph_series_s=times, loop_s=t_loop,
                             eager_s=t_eager, roofline_s=roof, weight_bytes=w_bytes, state_bytes=state_page,
                             kv_bytes_per_token=kv_token))  # fmt: skip
            eager = f"{t_eager * 1e3:.1f} ms" if t_eager is not None else "-"
            lines.append(
                f"| {name} | {B} | {t_graph * 1e3:.2f} ms | {t_loop * 1e3:.2f} ms | {roof * 1e3:.2f} ms | "
                f"{t_graph / roof:.2f}x | {t_loop / roof:.2f}x | {eager} | {B / t_loop:,.0f} |"
            )
            if a.speculative:
                t_verify, t_both = time_speculative(runner, B, a, gen)
                rows[-1].update(verify_s=t_verify, verify_mtp_s=t_both)
                both = f"{t_both * 1e3:.2f} ms ({t_both / t_graph:.2f}x)" if t_both is not None else "-"
                spec_lines.append(f"| {name} | {B} | {t_graph * 1e3:.2f} ms | {t_verify * 1e3:.2f} ms "
                                  f"({t_verify / t_graph:.2f}x) | {both} | {t_verify / roof:.2f}x |")  # fmt: skip
            write()
        if a.prefill:
            page = max(a.batches)
            slots = list(range(a.prefill))
            warm = a.prefill // 8
            runner.forward([Span([5] * warm, 0, slots[:warm], None, page)])
            ids = torch.randint(3, cfg.vocab_size, (a.prefill,), generator=gen).tolist()
            torch.cuda.synchronize()
            t = time.perf_counter()
            runner.forward([Span(ids, 0, slots, None, page)])
            torch.cuda.synchronize()
            t_pre = time.perf_counter() - t
            if a.profile:
                span = Span(ids, 0, slots, None, page)
                profile_kernels(lambda r=runner, sp=span: r.forward([sp]),
                                f"{name} prefill of {a.prefill} tokens", reps=1, top=20)  # fmt: skip
            T = a.prefill
            flops = 2 * params * T + len(cfg.full_layers) * 4 * (T * T / 2) * cfg.num_heads * cfg.head_dim
            rows.append(dict(model=name, prefill_tokens=T, prefill_s=t_pre, flops=flops, matmul_flops=mm))
            prefill_lines.append(
                f"| {name} | {T:,} | {t_pre:.2f} s | {T / t_pre:,.0f} | {flops / t_pre / 1e12:,.0f} TFLOP/s | "
                f"{flops / t_pre / mm:.2f} |"
            )
        choice = getattr(runner.model, "linear_choice", {})
        times = getattr(runner.model, "linear_times", {})
        rows.append(
            dict(
                model=name,
                linear_choice={f"{n}@{bs}": c for (n, bs), c in sorted(choice.items())},
                linear_times={f"{n}@{bs}": t for (n, bs), t in sorted(times.items()) if bs in a.batches},
            )
        )
        for (n, bs), t in sorted(times.items()):  # cuBLAS against the fastest skinny setting, per projection
            if bs in a.batches and isinstance(t.get("cublas"), float):
                sk = fastest_where(t, lambda k: k != "cublas")
                pre = fastest_where(t, lambda k: "'preload': True" in k)
                ahead = fastest_where(t, lambda k: "'prefetch': True" in k)
                split = fastest_where(t, lambda k: "'splits'" in k and "'defer'" not in k)
                dfr = fastest_where(t, lambda k: "'defer': True" in k)
                print(f"{name}, graph of {bs}, {n}: cuBLAS {t['cublas'] * 1e6:.1f} us, skinny best "
                      + (f"{sk * 1e6:.1f} us" if sk is not None else "-")
                      + (f" (preloading {pre * 1e6:.1f} us)" if pre is not None else "")
                      + (f" (prefetching {ahead * 1e6:.1f} us)" if ahead is not None else "")
                      + (f" (K split {split * 1e6:.1f} us, partials added by the norm {dfr * 1e6:.1f} us)"
                         if dfr is not None and split is not None else ""), flush=True)  # fmt: skip
        flags = ("swap", "splits", "gated", "norm", "conv", "glu", "unroll", "preload", "prefetch", "defer")
        for bs in sorted({bs for _, bs in choice} & set(a.batches)):
            fused = {n: "+".join(k for k in flags if c.get(k)) for (n, b), c in sorted(choice.items()) if b == bs}
            print(f"{name}, graph of {bs}: skinny_linear for " + ", ".join(f"{n} ({f or 'plain'})" for n, f in
                                                                            fused.items()), flush=True)  # fmt: skip
        delta_choice = getattr(runner.model, "delta_choice", {})
        delta_times = getattr(runner.model, "delta_times", {})
        rows.append(
            dict(
                model=name,
                delta_choice={str(bs): c for bs, c in sorted(delta_choice.items())},
                delta_times={str(bs): t for bs, t in sorted(delta_times.items()) if bs in a.batches},
            )
        )
        for bs, t in sorted(delta_times.items()):  # the pick against step_settings' block, per layer
            if bs in a.batches:
                pick = delta_choice.get(bs)
                default = t.get(str(dict(block_v=delta_rule.step_settings(bs)["block_v"])))
                took = t.get(str(pick)) if pick is not None else None
                print(f"{name}, graph of {bs}: delta step {pick or 'defaults'}"
                      + (f" {took * 1e6:.1f} us" if isinstance(took, float) else "")
                      + (f" (defaults {default * 1e6:.1f} us)" if isinstance(default, float) else ""),
                      flush=True)  # fmt: skip
        for cache in (linear.tune_cache(), delta_tune.step_tune_cache()):
            if cache.path is not None:  # picks from an earlier process were timed there, not in this run
                print(f"{name}: tuning cache {cache.path}: {cache.hits} picks taken from it, {cache.misses} timed "
                      "here", flush=True)  # fmt: skip
        lines.append(
            f"| ({name}: weights read per step {w_bytes / 1e9:.2f} GB at batch {B}, "
            f"state page {state_page / 2**20:.1f} MiB, "
            f"K/V {kv_token // 1024} KiB per token; load + capture {t_load:.0f} s) | | | | | | | | |"
        )
        write()
        del runner
        torch.cuda.empty_cache()
    if series_lines:
        lines += ["", f"Graph step, each of {a.series} series of {a.reps} replays (first to last; the table gives "
                  "their median):", "", *(f"- {x}" for x in series_lines)]  # fmt: skip
    if spec_lines:
        lines += ["", "Speculative step (`--speculative`): each sequence verifies its input token and one draft "
                  "(2 query rows), then the MTP head drafts from both; two tokens per sequence when the draft is "
                  "kept.", "", "| model | batch | decode step | verify | verify + MTP | verify / roofline |",
                  "|---|---:|---:|---:|---:|---:|", *spec_lines]  # fmt: skip
    if prefill_lines:
        lines += ["", "| model | prompt | prefill | tokens/s | model FLOP rate | of matmul rate |",
                  "|---|---:|---:|---:|---:|---:|", *prefill_lines]  # fmt: skip
    return finish(timer, lines, write)


if __name__ == "__main__":
    sys.exit(main())
