"""The fused MoE kernels (kernels.moe) on one MoE layer against their memory roofline and against the loop over
experts (HybridModel.mlp's routed part), measured in the same run.

    python perf/engine.py moe [--experts 256 --top-k 8 --hidden 2048 --inter 512] [--batches 1 8 32 128]
                             [--prefill 4096] [--chain 8] [--sweep] [--out FILE.md]

Defaults: Qwen3.5-35B-A3B's MoE layer (transformers' Qwen3_5MoeTextConfig). The whole MoE layer (router, top-k,
routed experts, shared expert and its gate) as the decode CUDA graph runs it (`kernels.moe`, timed as a captured
graph and eagerly) against HybridModel.mlp's loop over experts (eager: it syncs with the host, so it cannot be
captured), in the same run. Roofline of a decode batch: the bytes the layer must read (the experts the batch routes
to, each read once, the shared expert and the router) over the device-to-device copy bandwidth measured here.
Prefill: one chunk of `--prefill` tokens, tokens/s of both paths. `--chain L`: L layers with weights of their own
in one graph, per layer (as a decode step runs them: no graph launch per layer, no weights left in L2). `--sweep`:
the grouped GEMMs' tile settings (kernels.moe.SETTINGS) timed per batch size, each kernel's choices in turn
(`small`: the matrix-vector path of a few tokens; `small_batch=0` is the grouped path, for comparison).
`--profile`: the graphed layer's kernels by GPU time. `--device cpu` (TRITON_INTERPRET=1) only checks that the
script runs, on small shapes."""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F

from perf.tools.limits import bounded_report, finish
from perf.tools.timing import capture_graph, cuda_time, graph_time


def loop_layer(x, w, K, norm):
    """HybridModel.mlp's MoE path (the reference: a host-synchronising loop over the routed experts, then the
    shared expert, stored as expert E, and its sigmoid gate, the router's last row)."""
    E = w["router"].shape[0] - 1
    logits = F.linear(x, w["router"])
    probs = torch.softmax(logits[:, :E], dim=-1, dtype=torch.float32)
    top_w, top_i = torch.topk(probs, K, dim=-1)
    if norm:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in top_i.unique().tolist():
        tok, slot = torch.where(top_i == e)
        g, u = F.linear(x[tok], w["gate_up"][e]).chunk(2, dim=-1)
        out.index_add_(0, tok, F.linear(F.silu(g) * u, w["down"][e]) * top_w.to(x.dtype)[tok, slot, None])
    g, u = F.linear(x, w["gate_up"][E]).chunk(2, dim=-1)
    shared = F.linear(F.silu(g) * u, w["down"][E])
    return out + torch.sigmoid(logits[:, E:]) * shared


def fused_layer(x, w, K, norm, settings=None):
    """HybridModel._fused_moe: router + shared gate GEMM, route (the shared expert as pair K), routed. settings:
    kernels.moe.SETTINGS to change, and "router": skinny_linear settings for the router's GEMM (None: cuBLAS), as
    the decode graphs choose them (`router_choices`)."""
    from kernels import linear, moe

    settings = settings or {}
    E = w["router"].shape[0] - 1
    logits = linear.linear(x, w["router"], settings.get("router"))
    top_w, top_i = moe.route(logits, K, norm, x.dtype, E, shared=True, num_warps=settings.get("route_warps"))
    return moe.routed(x, top_i, top_w, w["gate_up"], w["down"], settings=settings)


# the whole layer at a few tokens, with the routed kernels' settings of the sweep's best: the route launch's warps
# and the router's GEMM in skinny_linear (one row: the weights' first tile read before the PDL wait)
LAYER_SWEEP = [dict(route_warps=wp) for wp in (1, 2, 4)] + [
    dict(route_warps=wp, router=dict(block_n=bn, block_k=bk, splits=sp, num_warps=4, num_stages=4, preload=True))
    for wp in (1, 4)
    for bn, bk, sp in ((4, 512, 1), (8, 256, 2), (4, 256, 2), (2, 512, 2))
]


def timed(fn, reps: int, cuda: bool, graph: bool = False) -> float:
    """Seconds per call: CUDA events on the GPU (perf.tools.timing; `graph`: fn captured once and replayed),
    wall time on the CPU."""
    if cuda and graph:
        return graph_time(fn, reps)
    if cuda:
        return cuda_time(fn, reps)
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


SWEEP = {
    "small": [dict(small_batch=0), dict(small_preload=False)]
    + [
        dict(small_bn=bn, small_down_bn=dbn, small_bk=512, small_down_bk=512, small_down_warps=4, small_preload=True)
        for bn in (4, 8, 16, 32)
        for dbn in (2, 4)
    ],  # fmt: skip
    "gate_up": [dict(bn=bn, bk=bk, stages=st) for bn in (32, 64) for bk in (64, 128, 256) for st in (2, 3, 4)],
    "down": [
        dict(down_bn=bn, down_bk=bk, down_stages=st) for bn in (32, 64, 128) for bk in (64, 128) for st in (2, 3, 4)
    ],
}


def router_choices(routers: list[torch.Tensor], sizes, cuda: bool) -> dict[int, dict | None]:
    """The router projection per batch size as a decode graph of that many rows chooses it at capture
    (kernels.linear.tune over the layers' routers: cuBLAS or skinny_linear); cuBLAS past linear.TUNE_ROWS and on
    the CPU."""
    from kernels import linear

    return {T: linear.tune(routers, T)[0] if cuda and T <= linear.TUNE_ROWS else None for T in sizes}


def chain_rows(a, lines, rows, write, bw, expert_bytes, dense_bytes, rand, inputs, cuda: bool) -> None:
    """`--chain L`: L MoE layers with weights of their own, run one after another in one captured graph (each on
    the batch's tokens; its routing from its own router), per layer against the same roofline summed over the L
    layers. A single layer replayed on its own pays a graph launch per layer and finds part of its 57 MB (batch 1)
    still in L2 from the replay before; a decode step does neither."""
    from kernels import moe

    E, K, H, I, L = a.experts, a.top_k, a.hidden, a.inter, a.chain  # noqa: E741
    layers = [dict(gate_up=rand(E + 1, 2 * I, H), down=rand(E + 1, H, I), router=rand(E + 1, H)) for _ in range(L)]
    lines += [
        "",
        f"## {L} MoE layers in one graph, each with its own weights (`--chain {L}`)",
        "",
        "| tokens | per layer | roofline per layer | per layer / roofline | one layer replayed alone / roofline |",
        "|---:|---:|---:|---:|---:|",
    ]
    for T in a.batches:
        x = inputs[T][0]
        roof = 0.0
        for lw in layers:
            top_w, top_i = moe.route(F.linear(x, lw["router"]), K, True, x.dtype, E, shared=True)
            roof += (top_i[:, :K].unique().numel() * expert_bytes + dense_bytes) / bw

        st = dict(router=router_choices([lw["router"] for lw in layers], [T], cuda)[T])

        def run(x=x, st=st):  # every layer reads the same tokens (PDL orders the launches as a data dependence would)
            for lw in layers:
                fused_layer(x, lw, K, True, st)

        t = (cuda_time(capture_graph(run).replay, a.reps) if cuda else timed(run, 1, False)) / L
        roof /= L
        alone = next((r["fused_graph_s"] / r["roofline_s"] for r in rows if r.get("tokens") == T), float("nan"))
        rows.append(dict(chain=L, tokens=T, per_layer_s=t, roofline_s=roof))
        lines.append(f"| {T} | {t * 1e3:.3f} ms | {roof * 1e3:.3f} ms | **{t / roof:.2f}x** | {alone:.2f}x |")
        write()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512, help="each expert's intermediate size (and the shared one's)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--prefill", type=int, default=4096, help="tokens of one prefill chunk (0: none)")
    ap.add_argument("--sweep", action="store_true", help="time the grouped GEMMs' tile settings per batch")
    ap.add_argument("--profile", action="store_true", help="print the graphed layer's kernels by GPU time")
    ap.add_argument("--chain", type=int, default=8,
                    help="also time this many MoE layers, each with its own weights, in one graph (as a decode step "
                         "runs its layers: no graph launch per layer, no weights left in L2 by the layer before); 0: "
                         "off")  # fmt: skip
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--time-limit", type=float, default=300)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("moe_bench: needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1 for a smoke run)", file=sys.stderr)
        return 2
    from kernels import moe

    dev, dtype = a.device, (torch.bfloat16 if cuda else torch.float32)
    E, K, H, I = a.experts, a.top_k, a.hidden, a.inter  # noqa: E741
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, device=dev, generator=gen) * 0.02).to(dtype)

    # as HybridModel holds them with the kernels: the shared expert is expert E, its gate the router's last row
    w = dict(gate_up=rand(E + 1, 2 * I, H), down=rand(E + 1, H, I), router=rand(E + 1, H))
    elt = w["down"].element_size()
    expert_bytes = 3 * H * I * elt
    dense_bytes = ((E + 1) * H + 3 * H * I) * elt  # router and shared gate, shared expert: read by every batch
    if cuda:
        src = torch.empty(2**28, device=dev)
        dst = torch.empty_like(src)
        bw = 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), 10, cuda)
    else:
        bw = float("nan")
    name = torch.cuda.get_device_name() if cuda else "CPU (interpreter)"
    lines = [
        f"# Fused MoE layer on {name} ({dtype})",
        "",
        f"{E} experts of {I}, top-{K}, hidden {H}, one shared expert of {I}; copy bandwidth {bw / 1e9:,.0f} GB/s "
        f"measured here. Command: `python perf/engine.py moe {' '.join(sys.argv[1:] if argv is None else argv)}`.",
        "",
        "| tokens | experts routed to | fused layer, graph | fused layer, eager | loop over experts "
        "| loop / fused graph | roofline | fused graph / roofline | routed kernels, graph / their roofline "
        "| max abs diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows: list[dict] = []
    write, timer = bounded_report(lines, a.out, rows, a.time_limit)
    norm = True
    sizes = list(a.batches) + ([a.prefill] if a.prefill else [])
    # the router as the decode graphs take it, tuned over 8 routers (a model's layers: not one left in L2)
    routers = router_choices([w["router"]] + [rand(E + 1, H) for _ in range(7)], sizes, cuda)
    lines[2] += f" Router projection per batch (None: cuBLAS): {routers}."
    inputs = {}
    for T in sizes:
        x = rand(T, H) * 50
        top_w, top_i = moe.route(F.linear(x, w["router"]), K, norm, dtype, E, shared=True)
        inputs[T] = (x, top_w, top_i)
        routed = top_i[:, :K].unique().numel()
        reps = a.reps if T <= 256 else max(3, a.reps // 10)
        st = dict(router=routers[T])
        t_graph = timed(partial(fused_layer, x, w, K, norm, st), reps, cuda, graph=cuda and T <= 256)
        t_eager = timed(partial(fused_layer, x, w, K, norm, st), reps, cuda)
        t_loop = timed(partial(loop_layer, x, w, K, norm), max(2, reps // 4), cuda)
        t_routed = timed(
            partial(moe.routed, x, top_i, top_w, w["gate_up"], w["down"]), reps, cuda, graph=cuda and T <= 256
        )
        diff = (fused_layer(x, w, K, norm, st).float() - loop_layer(x, w, K, norm).float()).abs().max().item()
        roof = (routed * expert_bytes + dense_bytes) / bw
        roof_routed = (routed + 1) * expert_bytes / bw  # with the shared expert, a pair of every token
        rows.append(
            dict(tokens=T, routed=routed, router=routers[T], fused_graph_s=t_graph, fused_eager_s=t_eager,
                 loop_s=t_loop, routed_graph_s=t_routed, roofline_s=roof, routed_roofline_s=roof_routed,
                 max_abs_diff=diff)
        )  # fmt: skip
        lines.append(
            f"| {T} | {routed} | {t_graph * 1e3:.3f} ms | {t_eager * 1e3:.3f} ms | {t_loop * 1e3:.3f} ms | "
            f"{t_loop / t_graph:.1f} | {roof * 1e3:.3f} ms | **{t_graph / roof:.2f}x** | "
            f"{t_routed / roof_routed:.2f}x | {diff:.1e} |"
        )
        if a.profile and cuda and T <= 256:
            from perf.tools.hybrid_bench import profile_kernels

            g = capture_graph(partial(fused_layer, x, w, K, norm, st))
            profile_kernels(g.replay, f"fused MoE layer, {T} tokens, graph", reps=10, sequence=12)
        if T == a.prefill:
            lines.append(f"\nPrefill chunk of {T} tokens: fused {T / t_graph:,.0f} tokens/s, loop {T / t_loop:,.0f}.")
        write()
    if a.chain:
        chain_rows(a, lines, rows, write, bw, expert_bytes, dense_bytes, rand, inputs, cuda)
    best: dict[tuple[str, int], tuple[float, dict]] = {}
    if a.sweep:
        lines += [
            "",
            "## Tile settings of the routed kernels (graph-timed `routed`, us; the other kernel at default)",
            "",
        ]
        for kernel, choices in SWEEP.items():
            head = " | ".join(",".join(f"{k}={v}" for k, v in c.items()) for c in choices)
            lines += [f"| {kernel}: tokens | {head} |", "|---:|" + "---:|" * len(choices)]
            for T in a.batches:
                if (kernel == "small") != (T <= moe.SMALL_BATCH):
                    continue
                x, top_w, top_i = inputs[T]
                cells = []
                for c in choices:
                    try:  # a tile that needs more shared memory than the GPU has does not compile
                        t = timed(partial(moe.routed, x, top_i, top_w, w["gate_up"], w["down"], settings=c), a.reps,
                                  cuda, graph=cuda)  # fmt: skip
                    except Exception as exc:  # noqa: BLE001 - listed, and the sweep goes on
                        rows.append(dict(sweep=kernel, tokens=T, settings=c, error=str(exc)[:200]))
                        cells.append("fails")
                        continue
                    rows.append(dict(sweep=kernel, tokens=T, settings=c, routed_graph_s=t))
                    cells.append(f"{t * 1e6:.1f}")
                    if t < best.get((kernel, T), (float("inf"),))[0]:
                        best[(kernel, T)] = (t, c)
                lines.append(f"| {T} | " + " | ".join(cells) + " |")
                write()
            lines.append("")
    if a.sweep:
        lines += ["## The whole layer at a few tokens: route warps and the router's GEMM (graph, us)", "",
                  "| tokens | settings | fused layer |", "|---:|---|---:|"]  # fmt: skip
        for T in [T for T in a.batches if T <= moe.SMALL_BATCH and ("small", T) in best]:
            x = inputs[T][0]
            for c in LAYER_SWEEP:
                st = {"router": routers[T], **best[("small", T)][1], **c}
                try:
                    t = timed(partial(fused_layer, x, w, K, norm, st), a.reps, cuda, graph=cuda)
                except Exception as exc:  # noqa: BLE001 - listed, and the sweep goes on
                    rows.append(dict(sweep="layer", tokens=T, settings=c, error=str(exc)[:200]))
                    continue
                rows.append(dict(sweep="layer", tokens=T, settings=c, fused_graph_s=t))
                lines.append(f"| {T} | `{c}` | {t * 1e6:.1f} |")
                if t < best.get(("layer", T), (float("inf"),))[0]:
                    best[("layer", T)] = (t, c)
                write()
        lines.append("")
    if best:
        lines += ["## The layer with the sweep's best settings (graph)", "",
                  "| tokens | fused layer | fused / roofline | settings |", "|---:|---:|---:|---|"]  # fmt: skip
        for T in a.batches:
            groups = ["small", "layer"] if T <= moe.SMALL_BATCH else ["gate_up", "down"]
            st = {"router": routers[T], **{k: v for g in groups if (g, T) in best for k, v in best[(g, T)][1].items()}}
            x = inputs[T][0]
            t = timed(partial(fused_layer, x, w, K, norm, st), a.reps, cuda, graph=cuda)
            roof = next(r["roofline_s"] for r in rows if r.get("tokens") == T and "roofline_s" in r)
            rows.append(dict(tuned=True, tokens=T, settings=st, fused_graph_s=t, roofline_s=roof))
            lines.append(f"| {T} | {t * 1e3:.3f} ms | **{t / roof:.2f}x** | `{st}` |")
            write()
    return finish(timer, lines, write)


if __name__ == "__main__":
    sys.exit(main())
