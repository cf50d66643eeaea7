"""The fused MoE kernels (kernels.moe) on one MoE layer against their memory roofline and against the loop over
experts (HybridModel.mlp's routed part), measured in the same run.

    python -m perf.moe_bench [--experts 256 --top-k 8 --hidden 2048 --inter 512] [--batches 1 8 32 128]
                             [--prefill 4096] [--out FILE.md]

Defaults: Qwen3.5-35B-A3B's MoE layer (transformers' Qwen3_5MoeTextConfig). Roofline of a decode batch: the bytes of
the experts the batch routes to (gate_up and down of each distinct expert, read once) over the device-to-device copy
bandwidth measured here; the shared expert and the router are not counted (they are the same dense work either
way). Prefill: one chunk of `--prefill` tokens, tokens/s of the fused kernels and of the loop. Routing is random
(softmax of random logits, top-k), the same for both paths. `--device cpu` (with TRITON_INTERPRET=1) only checks
that the script runs, on small shapes."""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F

from perf.hybrid_bench import cuda_time
from perf.limits import report_writer, wall_clock_limit


def loop(x, top_i, top_w, gate_up, down):
    out = torch.zeros_like(x)
    for e in top_i.unique().tolist():
        tok, slot = torch.where(top_i == e)
        g, u = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        out.index_add_(0, tok, F.linear(F.silu(g) * u, down[e]) * top_w[tok, slot, None])
    return out


def timed(fn, reps: int, cuda: bool) -> float:
    """Seconds per call: CUDA events on the GPU (hybrid_bench's timer), wall time on the CPU."""
    if cuda:
        return cuda_time(fn, reps)
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512, help="each expert's intermediate size")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--prefill", type=int, default=4096, help="tokens of one prefill chunk (0: none)")
    ap.add_argument("--reps", type=int, default=20)
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
    gate_up = torch.randn(E, 2 * I, H, device=dev, generator=gen).to(dtype) * 0.02
    down = torch.randn(E, H, I, device=dev, generator=gen).to(dtype) * 0.02
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
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
        f"{E} experts of {I}, top-{K}, hidden {H}; copy bandwidth {bw / 1e9:,.0f} GB/s measured here. Command: "
        f"`python -m perf.moe_bench {' '.join(sys.argv[1:] if argv is None else argv)}`.",
        "",
        "| tokens | experts routed to | fused | loop over experts | fused / loop | roofline | fused / roofline | "
        "max abs diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows: list[dict] = []
    write = report_writer(lines, a.out, rows)
    timer = wall_clock_limit(a.time_limit, write, [])
    sizes = list(a.batches) + ([a.prefill] if a.prefill else [])
    for T in sizes:
        x = torch.randn(T, H, device=dev, generator=gen).to(dtype)
        probs = torch.softmax(torch.randn(T, E, device=dev, generator=gen), -1)
        top_w, top_i = torch.topk(probs, K, dim=-1)
        top_w = top_w.to(dtype)
        routed = top_i.unique().numel()
        fused, looped = (partial(fn, x, top_i, top_w, gate_up, down) for fn in (moe.routed, loop))
        t_fused = timed(fused, a.reps, cuda)
        t_loop = timed(looped, max(2, a.reps // 4), cuda)
        diff = fused().float() - looped().float()
        roof = routed * expert_bytes / bw
        rows.append(dict(tokens=T, routed=routed, fused_s=t_fused, loop_s=t_loop, roofline_s=roof))
        lines.append(
            f"| {T} | {routed} | {t_fused * 1e3:.3f} ms | {t_loop * 1e3:.3f} ms | {t_fused / t_loop:.2f} | "
            f"{roof * 1e3:.3f} ms | {t_fused / roof:.2f}x | {diff.abs().max().item():.1e} |"
        )
        write()
    timer.cancel()
    lines += ["", f"Measured {time.strftime('%Y-%m-%d %H:%M')}."]
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
