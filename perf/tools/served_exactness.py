"""Served greedy answers against the offline engine's, token for token, on the same machine in the same run.

    python perf/served.py exactness [--model smollm2] [--device cpu|gpu] [--prompts 8] [--new-tokens 64]

Each prompt is answered alone (batch 1) by the offline engine, then alone by a real server (1 prefill + 1 decode
instance) with decode's overlapped loop on (`--decode-overlap on`, the default) and off. Alone, both paths run the
same kernels on the same shapes, so the answers must be identical: any difference is a bug in the served path
(the hand-off, the overlapped loop's placeholders, detokenisation) and the script exits 1. The same prompts are then
sent all at once to each server; those answers are reported, not required to match: batch composition changes the
floating-point reductions, so bf16 argmax ties may break differently.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

from backends.common.core.request import SamplingParams
from backends.common.engine.engine import Engine
from perf.tools.limits import wall_clock_limit
from tests.server.client import grpc_generate
from tests.server.conftest import Server


def served(server: Server, prompts, n: int, concurrent: bool) -> list[list[int]]:
    out: list[list[int] | None] = [None] * len(prompts)

    def one(i):
        r = grpc_generate(server.grpc_url, ids=prompts[i], params={"max_tokens": n, "temperature": 0}, timeout=120)
        out[i] = r.ids if r.error is None else [f"error: {r.error}"]

    if not concurrent:
        for i in range(len(prompts)):
            one(i)
        return out
    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--time-limit", type=float, default=600, help="seconds; then what was measured is written")
    ap.add_argument("--out", default=None, help="also write the report (markdown) here")
    a = ap.parse_args()
    gpu = a.device == "gpu"
    dtype = "bfloat16" if gpu else "float32"
    lines = [f"Served greedy answers against the offline engine ({a.model}, {dtype}, {a.device})", ""]
    servers: list[Server] = []

    def report(extra=()):
        text = "\n".join([*lines, *extra])
        print(text, flush=True)
        if a.out:
            Path(a.out).write_text("# " + text + "\n")

    timer = wall_clock_limit(a.time_limit, lambda note: report(["", note]), servers)
    engine = Engine(a.model, dtype, "cuda" if gpu else "cpu", kv_tokens=32768, max_batch=64, chunk_size=512,
                    max_batch_tokens=4096)  # fmt: skip
    topics = ["the printing press", "tides", "the immune system", "prime numbers", "glaciers", "the violin",
              "photosynthesis", "the Roman roads", "volcanoes", "compilers", "bees", "the telescope"]  # fmt: skip
    prompts = [engine.tokenizer.encode(f"Write a short essay about {topics[i % len(topics)]}, part {i}:")
               for i in range(a.prompts)]  # fmt: skip
    params = SamplingParams(max_tokens=a.new_tokens, temperature=0)
    offline = [engine.generate([p], params)[0].output_ids for p in prompts]
    del engine
    if gpu:
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
    failed = False
    lines += ["| decode overlap | requests | identical to offline (alone) | identical to offline (all at once) |",
              "|---|---|---|---|"]  # fmt: skip
    for overlap in ("on", "off"):
        args = ["--model", a.model, "--device", a.device, "--dtype", dtype, "--kv-tokens", "32768",
                "--decode-overlap", overlap, "--chunk-size", "512", "--max-prefill-tokens", "4096"]  # fmt: skip
        server = Server(*args, name=f"exact-{overlap}")
        servers.append(server)
        try:
            alone = served(server, prompts, a.new_tokens, concurrent=False)
            together = served(server, prompts, a.new_tokens, concurrent=True)
            overlapped = server.metric("pd_decode_overlapped_steps_total")
        finally:
            server.stop()
            servers.remove(server)
        same_alone = sum(x == y for x, y in zip(alone, offline))
        same_together = sum(x == y for x, y in zip(together, offline))
        failed |= same_alone != len(prompts)
        lines.append(
            f"| {overlap} ({overlapped:.0f} steps overlapped) | {len(prompts)} | {same_alone} | {same_together} |"
        )
        for i, (x, y) in enumerate(zip(alone, offline)):
            if x != y:
                k = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                lines.append(f"  - prompt {i} alone, overlap {overlap}: first difference at output {k}")
        report()
    timer.cancel()
    lines += [
        "",
        "FAILED: an answer given alone differs from the offline engine's" if failed else "alone: all identical",
    ]
    report()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
