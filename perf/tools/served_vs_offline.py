"""Served time per output token against the offline engine's step time, same machine, same run (CPU by default).

    python perf/served.py vs-offline [--batches 1 16] [--new-tokens 64] [--overlap on off] [--replies socket bls]
    python perf/served.py vs-offline --model random:llama3.1-8b --device gpu --batches 1 32 128 \
        --new-tokens 256 --kv-tokens 65536 --overlap on off --out perf/results/served_vs_offline_h200.md (H200)

Served: B concurrent gRPC streams (greedy, EOS ignored) against a real tritonserver (1 prefill + 1 decode);
time per output token = (last token time - time of token n/4) / (tokens after it), averaged over the streams (the
first quarter is left out: it overlaps the other streams' prefills, which the offline figure does not include).
Offline: the engine's decode step time at the same batch size, measured in this process. The difference is what
serving adds: BLS and response IPC, detokenisation on master, and (on 2 cores) CPU contention between the
tritonserver, master, decode and prefill processes.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from backends.common.core.request import SamplingParams
from backends.common.engine.engine import Engine
from perf.tools.limits import wall_clock_limit
from tests.server.client import StreamClient
from tests.server.conftest import Server


def offline_step_time(engine: Engine, prompts, n: int) -> float:
    """Mean decode step time once every request is past prefill."""
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    times = []
    while engine.has_work():
        decoding = (
            all(len(r.slots) == r.num_tokens - 1 for r in engine.scheduler.running) and not engine.scheduler.waiting
        )
        t = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - t)
    return statistics.mean(times[2:])


def served_tpot(server: Server, prompts, n: int) -> float:
    """Streams' token arrival times; time per output token counted only once every stream is decoding (after the
    last first token), as tokens received after that moment over the time they took, averaged over streams."""
    stamps: list[list[float]] = [[] for _ in prompts]

    def go(i):
        c = StreamClient(
            server.grpc_url, ids=prompts[i], params={"max_tokens": n, "temperature": 0, "ignore_eos": True}
        )
        r = c.result
        while r.finish_reason is None and r.error is None:
            k = len(r.ids)
            c.read(until_tokens=k + 1)
            stamps[i] += [time.monotonic()] * (len(r.ids) - k)
        c.close()

    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    t0 = max(s[0] for s in stamps)
    tpots = []
    for s in stamps:
        after = [t for t in s if t > t0]
        if len(after) >= 2:
            tpots.append((after[-1] - t0) / len(after))
    return statistics.mean(tpots)


def serve(a, dtype: str, overlap: str, replies: str) -> Server:
    args = ["--model", a.model, "--device", a.device, "--dtype", dtype, "--kv-tokens", str(a.kv_tokens)]
    args += ["--max-batch", str(max(a.batches)), "--max-streams", str(max(max(a.batches), 64))]
    args += ["--decode-overlap", overlap, "--decode-replies", replies]
    if a.device == "gpu":
        args += ["--prefill-kv-tokens", "32768"]
    return Server(*args, name=f"perf-{overlap}-{replies}")


def write(a, lines: list[str]) -> None:
    print("\n".join(lines), flush=True)
    if a.out:
        Path(a.out).write_text("# " + "\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--kv-tokens", type=int, default=16384, help="decode pool (and the offline engine's)")
    ap.add_argument(
        "--overlap", nargs="+", choices=["on", "off"], default=["on"], help="served decode loops to measure"
    )
    ap.add_argument(
        "--replies",
        nargs="+",
        choices=["socket", "bls"],
        default=["socket"],
        help="how decode answers master (--decode-replies) in the served runs",
    )
    ap.add_argument("--time-limit", type=float, default=1200, help="seconds; then what was measured is written")
    ap.add_argument("--out", default=None, help="also write the table (markdown) here, after every row")
    a = ap.parse_args()
    gpu = a.device == "gpu"
    dtype = "bfloat16" if gpu else "float32"
    head = [
        f"Served TPOT vs offline decode step ({a.model}, {dtype}, {a.device}, {a.new_tokens} new tokens)",
        "",
        "| decode overlap | decode replies | batch | served ms/token | offline step ms | ratio | overlapped steps |",
        "|---|---|---|---|---|---|---|",
    ]
    rows: list[str] = []
    servers: list[Server] = []

    timer = wall_clock_limit(a.time_limit, lambda note: write(a, head + rows + ["", note]), servers)
    engine = Engine(
        a.model, dtype, "cuda" if gpu else "cpu", kv_tokens=a.kv_tokens, max_batch=max(a.batches),
        max_batch_tokens=8192 if gpu else 2048,
    )  # fmt: skip
    text = "A short history of the printing press and its effect on science. " * 40
    base = engine.tokenizer.encode(text)
    prompts = {b: [base[i : i + 32] for i in range(b)] for b in a.batches}
    offline_step_time(engine, prompts[a.batches[0]], 8)  # warm-up
    offline = {b: offline_step_time(engine, prompts[b], a.new_tokens) for b in a.batches}
    del engine
    if gpu:
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
    for overlap, replies in [(o, r) for o in a.overlap for r in a.replies]:
        server = serve(a, dtype, overlap, replies)
        servers.append(server)
        try:
            served_tpot(server, prompts[a.batches[0]], 16)  # warm-up
            for b in a.batches:
                before = server.metric("pd_decode_overlapped_steps_total")
                sv = served_tpot(server, prompts[b], a.new_tokens)
                n = int(server.metric("pd_decode_overlapped_steps_total") - before)
                rows.append(
                    f"| {overlap} | {replies} | {b} | {sv * 1e3:.2f} | {offline[b] * 1e3:.2f} "
                    f"| {sv / offline[b]:.2f} | {n} |"
                )
                write(a, head + rows)
        finally:
            server.stop()
            servers.remove(server)
    timer.cancel()


if __name__ == "__main__":
    main()
