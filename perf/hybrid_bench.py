"""The hybrid (Qwen3-Next layout) engine on a GPU: decode step time with the Triton delta-rule kernels and with
the PyTorch reference path, against the step's memory roofline measured in the same run, and prefill throughput.

    python -m perf.hybrid_bench [--model random:qwen3-next-layout] [--batches 1 32 128] [--out FILE.md]

The roofline of one decode step: weight bytes + the full-attention layers' K/V bytes + the linear-attention
state bytes (read and written), over the device-to-device copy bandwidth measured here. Every linear-attention
layer other than the gated delta rule (projections, conv, norms) and the full-attention layers run in PyTorch
ops without CUDA graphs on this path, so the host's launch overhead shows at small batches."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from perf.limits import report_writer, wall_clock_limit


def copy_bandwidth() -> float:
    n = 2**29  # 2 GiB of float32
    src = torch.empty(n // 4, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * (n) * 10 / (time.perf_counter() - t)  # bytes read + written per second


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:qwen3-next-layout")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--paths", nargs="+", default=["triton", "torch"], choices=["triton", "torch"])
    ap.add_argument("--time-limit", type=float, default=420)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("hybrid_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    from backends.common.engine import Engine
    from backends.common.request import SamplingParams

    rows: list[dict] = []
    lines = [f"# Hybrid engine ({a.model}, bfloat16) on {torch.cuda.get_device_name()}", ""]

    write = report_writer(lines, a.out, rows)

    timer = wall_clock_limit(a.time_limit, write, [])
    bw = copy_bandwidth()
    lines += [f"Copy bandwidth measured here: {bw / 1e9:.0f} GB/s. Command: `python -m perf.hybrid_bench`.", ""]
    lines += [
        "| path | batch | step | roofline | of roofline | decode tok/s | prefill tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    gen = torch.Generator().manual_seed(0)
    for path in a.paths:
        eng = Engine(a.model, dtype="bfloat16", device="cuda", kv_tokens=max(a.batches) * (a.context + 64) + 64,
                     max_batch=max(a.batches), chunk_size=2048, max_batch_tokens=8192, backend=path,
                     state_pages=2 * max(a.batches) + 8)  # fmt: skip
        cfg = eng.cfg
        weight_bytes = sum(t.numel() * t.element_size() for t in eng.runner.model.w.values())
        state_bytes = eng.runner.state.bytes_per_page
        kv_per_token = eng.runner.kv.bytes_per_slot
        for B in a.batches:
            prompts = [torch.randint(0, cfg.vocab_size, (a.context,), generator=gen).tolist() for _ in range(B)]
            reqs = [eng.add_request(p, SamplingParams(max_tokens=a.steps + 4, temperature=0, ignore_eos=True))
                    for p in prompts]  # fmt: skip
            torch.cuda.synchronize()
            t = time.perf_counter()
            while any(len(r.output_ids) == 0 for r in reqs):
                eng.step()
            torch.cuda.synchronize()
            t_prefill = time.perf_counter() - t
            eng.step()  # warm-up decode step
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(a.steps):
                eng.step()
            torch.cuda.synchronize()
            step = (time.perf_counter() - t) / a.steps
            while eng.has_work():
                eng.step()
            eng.scheduler.radix.clear()
            bound = (weight_bytes + B * (a.context * kv_per_token + 2 * state_bytes)) / bw
            rows.append(dict(path=path, batch=B, step_s=step, roofline_s=bound, prefill_s=t_prefill,
                             prefill_tokens=B * a.context))  # fmt: skip
            lines.append(
                f"| {path} | {B} | {step * 1e3:.2f} ms | {bound * 1e3:.2f} ms | {bound / step:.2f} | "
                f"{B / step:,.0f} | {B * a.context / t_prefill:,.0f} |"
            )
            write()
        del eng
        torch.cuda.empty_cache()
    timer.cancel()
    lines += ["", f"Weights {weight_bytes / 1e9:.2f} GB; state {state_bytes / 2**20:.1f} MiB per request.",
              f"Measured {time.strftime('%Y-%m-%d %H:%M')}."]  # fmt: skip
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
