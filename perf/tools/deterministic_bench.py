"""What `--deterministic` costs on a GPU (issue #29): the dense model's decode step (CUDA graph, one new token per
sequence over `--context` cached tokens) at several batch sizes and one long prefill, with the default kernels and
with the batch-invariant ones (kernels.invariant), measured in the same run, plus a check that the deterministic
runner's greedy tokens for one sequence are the same alone and inside the largest batch.

    python perf/engine.py deterministic [--model random:llama3.1-8b] [--batches 1 32 128] [--context 1024]
                                       [--prefill 8192] [--time-limit 300] [--out FILE.md]

Issue #29's target: decode <= 10% slower, prefill <= 20% slower. Each mode loads its own runner (random weights,
same seed), one after the other; results are written after every measurement, so a run stopped by the time limit
still leaves what it measured."""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch


def decode_step(runner, batch: int, context: int, reps: int) -> float:
    """Seconds per decode step of `batch` sequences at `context` cached tokens (graph replays, host work in)."""
    from backends.common.model.batch import Span

    per = context + 8
    spans = [Span([1], context, list(range(i * per, i * per + context + 1)), ("d", batch, i)) for i in range(batch)]
    runner.forward(spans)  # table rows and warm-up
    runner.forward(spans)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        runner.forward(spans)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def prefill(runner, tokens: int, reps: int) -> float:
    from backends.common.model.batch import Span

    ids = [(i * 7919) % runner.cfg.vocab_size for i in range(tokens)]
    slots = list(range(tokens))
    runner.forward([Span(ids, 0, slots, ("p", 0))])  # warm-up (compiles the prefill kernels at this size)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for r in range(reps):
        runner.forward([Span(ids, 0, slots, ("p", r + 1))])
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def greedy_alone_equals_batched(runner, batch: int, context: int, steps: int = 16) -> bool:
    """One sequence's greedy tokens over `steps` decode steps, alone and as row 0 of `batch` sequences."""
    from backends.common.model.batch import Span

    V = runner.cfg.vocab_size
    prompt = [(i * 31 + 5) % V for i in range(context)]

    def run(n: int, base: int) -> list[int]:
        per = context + steps + 8
        seqs = [[(i * 31 + 5 + 17 * j) % V for i in range(context)] if j else list(prompt) for j in range(n)]
        slots = [list(range(base + j * per, base + (j + 1) * per)) for j in range(n)]
        out = []
        for j in range(n):
            logits = runner.forward([Span(seqs[j], 0, slots[j], ("g", base, j))])
            seqs[j].append(int(logits[0].argmax()))
        out.append(seqs[0][-1])
        for _ in range(steps):
            spans = [Span(s[-1:], len(s) - 1, slots[j], ("g", base, j)) for j, s in enumerate(seqs)]
            toks = runner.forward(spans).argmax(-1).tolist()
            for s, t in zip(seqs, toks):
                s.append(t)
            out.append(toks[0])
        return out

    return run(1, 0) == run(batch, context + steps + 8)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama3.1-8b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=8192, help="prompt tokens of the prefill measurement (0: none)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--check-batch", type=int, default=32, help="batch of the greedy alone-vs-batched check (0: off)")
    ap.add_argument("--time-limit", type=float, default=300.0)
    ap.add_argument("--out", default="deterministic_bench.md")
    a = ap.parse_args()
    from backends.common.engine.runner import ModelRunner

    t0 = time.time()
    kv_tokens = max(max(a.batches) * (a.context + 8), a.prefill, 2 * (a.context + 40) * max(a.check_batch, 1))
    res: dict = {"model": a.model, "context": a.context, "decode": {}, "prefill": {}, "check": {}}

    def write() -> None:
        Path(a.out).with_suffix(".json").write_text(json.dumps(res, indent=1))
        lines = [
            f"# `--deterministic` against the default kernels ({a.model}, {torch.cuda.get_device_name(0)}, bf16)",
            "",
            f"Command: `python perf/engine.py deterministic {' '.join(sys.argv[1:])}`",
            "",
            "| measurement | default | deterministic | deterministic / default |",
            "|---|---:|---:|---:|",
        ]
        for b in a.batches:
            d = res["decode"].get(str(b), {})
            f, g = d.get("default"), d.get("deterministic")
            ratio = f"{g / f:.3f}" if f and g else "-"
            fmt = lambda x: f"{x * 1e3:.2f} ms" if x else "-"  # noqa: E731
            lines.append(f"| decode step, batch {b}, context {a.context} | {fmt(f)} | {fmt(g)} | {ratio} |")
        if a.prefill:
            f, g = res["prefill"].get("default"), res["prefill"].get("deterministic")
            ratio = f"{g / f:.3f}" if f and g else "-"
            fmt = lambda x: f"{x:.3f} s" if x else "-"  # noqa: E731
            lines.append(f"| prefill of {a.prefill} tokens | {fmt(f)} | {fmt(g)} | {ratio} |")
        for mode, ok in res["check"].items():
            lines.append(f"\nGreedy tokens of one sequence alone and as row 0 of {a.check_batch} ({mode}): "
                         f"{'identical' if ok else 'DIFFERENT'}.")  # fmt: skip
        lines.append(f"\nMeasured {time.strftime('%Y-%m-%d %H:%M')} in {time.time() - t0:.0f} s.")
        Path(a.out).write_text("\n".join(lines) + "\n")

    for mode in ("default", "deterministic"):
        if time.time() - t0 > a.time_limit:
            print(f"time limit reached before {mode}", flush=True)
            break
        t = time.time()
        runner = ModelRunner(a.model, "bfloat16", "cuda", kv_tokens, max_batch=max(max(a.batches), a.check_batch),
                             deterministic=mode == "deterministic")  # fmt: skip
        print(f"{mode}: loaded and captured in {time.time() - t:.0f} s", flush=True)
        for b in a.batches:
            if time.time() - t0 > a.time_limit:
                break
            res["decode"].setdefault(str(b), {})[mode] = dt = decode_step(runner, b, a.context, a.reps)
            print(f"{mode}: decode batch {b}: {dt * 1e3:.2f} ms", flush=True)
            write()
        if a.prefill and time.time() - t0 < a.time_limit:
            res["prefill"][mode] = dt = prefill(runner, a.prefill, 3)
            print(f"{mode}: prefill {a.prefill}: {dt:.3f} s", flush=True)
            write()
        if a.check_batch and time.time() - t0 < a.time_limit:
            res["check"][mode] = ok = greedy_alone_equals_batched(runner, a.check_batch, 200)
            print(f"{mode}: greedy alone == batched: {ok}", flush=True)
            write()
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
