"""Launch settings measured inside the hybrid decode step rather than alone: one model runner, its decode graph of
one batch size recaptured for each variant and replayed, against the tuned picks recaptured first and last in the
same run. `kernels.linear.tune` times a projection's candidates in a graph of that projection's launches only; a
setting can rank differently among the other launches of a step (programmatic dependent launch, L2 traffic of the
delta step's state), and this shows by how much.

    python -m perf.instep_sweep [--model random:qwen3-next-layout] [--batch 32]
                                --what gate_up|in_proj|attn|attn_qk|norm_late|whatif [...] [--attn-splits 4 8 16]
                                [--attn-tiles 32,4,2 ...] [--reps 40] [--time-limit 240] [--out FILE.md]

--what gate_up / in_proj: that projection's pick replaced by cuBLAS and by skinny_linear settings near it (fewer
stages, preload, K split, the w @ x.T form without a split). --what attn: the decode attention's settings
(`kernels.attention.decode_settings`) replaced by splits x (key block, warps, stages) (--attn-tiles, default
ATTN_TILES). --what attn_qk: the q/k norms, rope and K/V store in the attention's launch (TRITON_PD_ATTN_QK=1,
`GpuHybrid.attn_qk`) against their own launch. --what norm_late: the add + RMSNorm before in_proj, qkv and
gate_up in those projections' launches in one pass (skinny_linear's norm_late; their picks' tiles with no K split
or w @ x.T, `norm_late_choice`), with and without prefetch, and with 8 warps, against the norms in their own
launches; out, o and down, whose products those norms read, then add up their own K split (no defer): their
fastest such setting that tuning timed, and a control row with only that change. --what whatif: the step with
one kind of launch left out (no add + RMSNorm, no conv step, no q/k norm + rope + K/V store, no decode attention;
each replaced by an empty output, so the tokens are garbage): how much that kind of launch costs the step, an
upper bound on what fusing it away could save. Each variant's graph is replayed twice (`graph`, two numbers: the
spread between them is the noise), and `loop` is the overlapped loop step as in perf.hybrid_bench.
Picks come from the tuning cache (TRITON_PD_TUNE_CACHE); a variant the cache lacks is only compiled, not tuned."""

from __future__ import annotations

import argparse
import itertools
import sys
import time
import types

import torch

from perf.limits import report_writer, wall_clock_limit

GLU = dict(dot=True, glu=True)
DOT = dict(dot=True)
PROJECTION_VARIANTS = {
    "gate_up": {
        "stages 3": dict(block_n=64, block_k=128, num_warps=4, num_stages=3, **GLU),
        "preload": dict(block_n=64, block_k=128, num_warps=4, num_stages=4, preload=True, **GLU),
        "block_n 32": dict(block_n=32, block_k=128, num_warps=4, num_stages=3, **GLU),
        "block_k 64": dict(block_n=64, block_k=64, num_warps=4, num_stages=4, **GLU),
        "block_k 64, stages 6": dict(block_n=64, block_k=64, num_warps=4, num_stages=6, **GLU),
        "K split 2": dict(block_n=64, block_k=128, num_warps=4, num_stages=3, splits=2, **GLU),
        "K split 2, stages 2": dict(block_n=64, block_k=128, num_warps=4, num_stages=2, splits=2, **GLU),
        "K split 2, block_n 32": dict(block_n=32, block_k=128, num_warps=4, num_stages=4, splits=2, **GLU),
        "K split 4, block_k 64": dict(block_n=64, block_k=64, num_warps=4, num_stages=4, splits=4, **GLU),
        "w @ x.T": dict(block_n=64, block_k=128, num_warps=4, num_stages=4, swap=True, **GLU),
        "w @ x.T, stages 3": dict(block_n=64, block_k=128, num_warps=4, num_stages=3, swap=True, **GLU),
        "w @ x.T, preload": dict(block_n=64, block_k=128, num_warps=4, num_stages=4, swap=True, preload=True, **GLU),
    },
    "in_proj": {
        "preload": dict(block_n=32, block_k=128, num_warps=4, num_stages=5, preload=True, **DOT),
        "block_n 64": dict(block_n=64, block_k=128, num_warps=4, num_stages=4, **DOT),
        "block_k 64, stages 6": dict(block_n=32, block_k=64, num_warps=4, num_stages=6, **DOT),
        "w @ x.T": dict(block_n=64, block_k=128, num_warps=4, num_stages=4, swap=True, **DOT),
        "w @ x.T, preload": dict(block_n=64, block_k=128, num_warps=4, num_stages=4, swap=True, preload=True, **DOT),
        "w @ x.T, block_n 128": dict(block_n=128, block_k=64, num_warps=4, num_stages=4, swap=True, **DOT),
        "w @ x.T, K split 2": dict(block_n=64, block_k=128, num_warps=4, num_stages=4, swap=True, splits=2, **DOT),
        "K split 2": dict(block_n=32, block_k=128, num_warps=4, num_stages=4, splits=2, **DOT),
    },
}
ATTN_TILES = ((32, 4, 2), (64, 4, 2), (32, 4, 3), (64, 8, 2), (32, 8, 2), (16, 4, 3))  # block_n, warps, stages


def _empty_norm(x, residual, weight, eps, out=None, offset=False, preload=False):
    parts = getattr(x, "parts", None)
    if parts is not None:
        return torch.empty(parts.shape[1:], dtype=x.dtype, device=parts.device)
    return torch.empty_like(x) if out is None else out


def _empty_conv(x, weight, conv_state, pages, out=None, out_pages=None, preload=False):
    return out


def _empty_rope(qkv, num_heads, num_kv_heads, *args, **kwargs):
    head_dim = qkv.shape[1] // (2 * num_heads + 2 * num_kv_heads)  # rows of q | gate | k | v
    return torch.empty(qkv.shape[0], num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)


def _empty_attention(q, *args, out=None, **kwargs):
    return torch.empty_like(q) if out is None else out


NORM_READERS = ("in_proj", "qkv", "gate_up")  # GpuHybrid.PROLOGUES' "norm"
NORM_WRITERS = ("out", "o", "down")  # GpuHybrid.EPILOGUES' "norm"
# a reader on cuBLAS gets this tile for its one-pass norm, by rows (up to 64, more): compiled for sm_90, the
# one-pass tile of 128 rows x 128 columns at 4 warps spilled 736 bytes, 64 x 64 at 8 warps none (169 registers)
NORM_LATE_TILES = {64: dict(block_n=32, block_k=128, num_warps=4, num_stages=3, dot=True),
                   128: dict(block_n=64, block_k=64, num_warps=8, num_stages=3, dot=True)}  # fmt: skip


def _fastest_without_defer(pick: dict | None, times: dict) -> dict | None:
    """A norm writer's setting when the norm after it is fused into the next projection (GpuHybrid._lin drops its
    defer): the fastest skinny_linear setting without defer that tuning timed (`times`: its descriptions, which
    are our own str(dict)s from the tuning cache), or the pick less defer; None (cuBLAS) where cuBLAS was faster."""
    import ast

    timed = sorted((t, k) for k, t in times.items() if isinstance(t, float) and (k == "cublas" or "'defer'" not in k))
    if not timed:
        return None if pick is None else {k: v for k, v in pick.items() if k != "defer"}
    return None if timed[0][1] == "cublas" else ast.literal_eval(timed[0][1])


def norm_late_choice(picks: dict, times: dict, batch: int, prefetch: bool | None, warps: int | None = None) -> dict:
    """{(projection, batch): settings or None} replacing picks: with prefetch None only the norm writers' (no
    defer, `_fastest_without_defer`); else also each norm reader's pick (NORM_LATE_TILES for cuBLAS) with the norm
    in its launch in one pass (norm_late; no K split, no w @ x.T, whose launches take no norm), prefetch as
    given, and `warps` warps where given (the one-pass tile of x in registers beside a glu's two accumulators
    spills at 4 warps on sm_90 for gate_up's 64 x 128 tile, not at 8)."""
    out = {(n, batch): _fastest_without_defer(picks.get((n, batch)), times.get((n, batch), {})) for n in NORM_WRITERS}
    if prefetch is not None:
        for n in NORM_READERS:
            base = picks.get((n, batch)) or NORM_LATE_TILES[64 if batch <= 64 else 128]
            tile = {k: v for k, v in base.items() if k not in ("splits", "swap", "defer", "prefetch", "norm_tile")}
            out[(n, batch)] = dict(
                tile, dot=True, norm=True, norm_late=True, **({"prefetch": True} if prefetch else {})
            )
            if warps is not None:
                out[(n, batch)]["num_warps"] = warps
    return out


def variants(what: str | list[str], attn_splits: list[int],
             attn_tiles: tuple[tuple[int, int, int], ...] = ATTN_TILES, picks: dict | None = None,
             times: dict | None = None, batch: int = 0) -> dict[str, tuple]:  # fmt: skip
    """{name: (kind, argument)}: ("pick", None) the tuned picks; ("linears", {(projection, batch): settings, or None
    for cuBLAS}) in place of those picks; ("attn", settings); ("attr", (a GpuHybrid
    attribute, its value)); ("leave out", (module, function name, its stand-in)). Several whats: their variants
    in turn between the picks. picks, times, batch: the model's linear_choice and linear_times and the graph's
    batch, for norm_late (none at one row, where the projections have no tensor-core tiles to fuse it in)."""
    from kernels import attention, delta_rule, norm, rope

    out: dict[str, tuple] = {"tuned picks": ("pick", None)}
    if isinstance(what, list):
        for w in what:
            out.update(list(variants(w, attn_splits, attn_tiles, picks, times, batch).items())[1:-1])
        out["tuned picks, again"] = ("pick", None)
        return out
    if what in PROJECTION_VARIANTS:
        out["cuBLAS"] = ("linears", {(what, batch): None})
        out.update({k: ("linears", {(what, batch): s}) for k, s in PROJECTION_VARIANTS[what].items()})
    elif what == "attn":
        for sp, (bn, nw, ns) in itertools.product(attn_splits, attn_tiles):
            name = f"splits {sp}, block_n {bn}, {nw} warps, {ns} stages"
            out[name] = ("attn", dict(num_splits=sp, block_n=bn, num_warps=nw, num_stages=ns))
    elif what == "attn_qk":
        out["q/k norms, rope and K/V store in the attention's launch"] = ("attr", ("attn_qk", True))
    elif what == "norm_late" and batch > 1:
        picks, times = picks or {}, times or {}
        for name, prefetch, warps in (
            ("out, o, down without defer (norms in their own launches)", None, None),
            ("one-pass norm in in_proj, qkv, gate_up", False, None),
            ("one-pass norm in in_proj, qkv, gate_up, prefetch", True, None),
            ("one-pass norm in in_proj, qkv, gate_up, 8 warps", False, 8),
        ):
            out[name] = ("linears", norm_late_choice(picks, times, batch, prefetch, warps))
    elif what == "whatif":
        out.update({
            "no add + RMSNorm": ("leave out", (norm, "add_rms_norm", _empty_norm)),
            "no conv step": ("leave out", (delta_rule, "conv_step", _empty_conv)),
            "no q/k norm + rope + K/V store": ("leave out", (rope, "qk_norm_rope_store_kv_", _empty_rope)),
            "no decode attention": ("leave out", (attention, "decode_attention", _empty_attention)),
        })  # fmt: skip
    out["tuned picks, again"] = ("pick", None)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:qwen3-next-layout")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--what", required=True, nargs="+",
                    choices=[*PROJECTION_VARIANTS, "attn", "attn_qk", "norm_late", "whatif"],
                    help="one or more: each's variants in turn, the picks first and last")  # fmt: skip
    ap.add_argument("--attn-splits", type=int, nargs="+", default=[4, 8, 16], help="--what attn: the splits tried")
    ap.add_argument("--attn-tiles", nargs="+", default=None, metavar="BLOCK_N,WARPS,STAGES",
                    help="--what attn: the key blocks tried (default: ATTN_TILES)")  # fmt: skip
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=40, help="graph replays and loop steps timed per variant")
    ap.add_argument("--time-limit", type=float, default=240)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    tiles = ATTN_TILES if a.attn_tiles is None else tuple(tuple(map(int, t.split(","))) for t in a.attn_tiles)
    if not torch.cuda.is_available():
        print("instep_sweep: needs a CUDA GPU", file=sys.stderr)
        return 2
    from backends.common.engine.runner import ModelRunner
    from kernels import attention
    from perf.hybrid_bench import copy_bandwidth, randomise, time_decode

    B = a.batch
    lines = [f"# Launch settings inside the decode step: {a.model}, batch {B}, on {torch.cuda.get_device_name()}", ""]
    write = report_writer(lines, a.out)
    timer = wall_clock_limit(a.time_limit, write, [])
    t0 = time.perf_counter()
    runner = ModelRunner(a.model, "bfloat16", "cuda", B * (a.context + a.reps + 8) + 64, max_batch=B,
                         state_pages=B + 2, graph_sizes=(B,))  # fmt: skip
    randomise(runner)
    model = runner.model
    picks = dict(model.linear_choice)
    lines += [
        f"Copy bandwidth {copy_bandwidth() / 1e9:,.0f} GB/s; load + capture {time.perf_counter() - t0:.0f} s. "
        f"Command: `python -m perf.instep_sweep {' '.join(argv if argv is not None else sys.argv[1:])}`.",
        "",
        "Tuned picks at this batch: "
        + "; ".join(f"{n}: {c}" for (n, bs), c in sorted(picks.items()) if bs == B),
        "",
        "| variant | graph step (two timings) | loop step |",
        "|---|---:|---:|",
    ]  # fmt: skip
    write()
    settings = attention.decode_settings
    timing = types.SimpleNamespace(context=a.context, reps=a.reps, eager_batches=[], profile=False)
    gen = torch.Generator().manual_seed(0)
    for name, (kind, arg) in variants(a.what, a.attn_splits, tiles, picks, dict(model.linear_times), B).items():
        choice = dict(picks)
        if kind == "linears":
            choice.update(arg)
            choice = {k: v for k, v in choice.items() if v is not None}  # None: cuBLAS
        if kind == "attn":
            attention.decode_settings = lambda *_, s=arg: dict(s)
        if kind == "leave out":
            module, fn, stand_in = arg
            original = getattr(module, fn)
            setattr(module, fn, stand_in)
        if kind == "attr":  # a setting of the model's graphs (GpuHybrid), restored after
            attr, value = arg
            before = getattr(model, attr)
            setattr(model, attr, value)
        model.linear_choice, model.linear_fixed = choice, True  # recaptured with these picks, not tuned
        try:
            model.capture([B])
            t1, loop, _ = time_decode(runner, B, timing, gen)
            t2, _, _ = time_decode(runner, B, timing, gen)
            lines.append(f"| {name} | {t1 * 1e3:.3f} / {t2 * 1e3:.3f} ms | {loop * 1e3:.3f} ms |")
        except Exception as e:  # a setting that does not compile or fit: recorded, the sweep goes on
            lines.append(f"| {name} | failed: {e!r:.160} | |")
            torch.cuda.synchronize()
        finally:
            attention.decode_settings = settings
            if kind == "leave out":
                setattr(module, fn, original)
            if kind == "attr":
                setattr(model, attr, before)
        write()
    timer.cancel()
    lines += ["", f"Measured {time.strftime('%Y-%m-%d %H:%M')}."]
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
