"""Served time per output token against the offline engine's step time, same machine, same run (CPU by default).

    python perf/served_vs_offline.py [--batches 1 16] [--new-tokens 64]

Served: B concurrent gRPC streams (greedy, EOS ignored) against a real tritonserver (1 prefill + 1 decode);
time per output token = (last token time - first token time) / (tokens - 1), averaged over the streams.
Offline: the engine's decode step time at the same batch size, measured in this process. The difference is what
serving adds: BLS and response IPC, detokenisation on master, and (on 2 cores) CPU contention between the
tritonserver, master, decode and prefill processes.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from backends.common.engine import Engine
from backends.common.request import SamplingParams
from tests.server.client import StreamClient
from tests.server.conftest import Server


def offline_step_time(engine: Engine, prompts, n: int) -> float:
    """Mean decode step time once every request is past prefill."""
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    times = []
    while engine.scheduler.has_work():
        decoding = (
            all(len(r.slots) == r.num_tokens - 1 for r in engine.scheduler.running) and not engine.scheduler.waiting
        )
        t = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - t)
    return statistics.mean(times[2:])


def served_tpot(server: Server, prompts, n: int) -> float:
    tpots = [0.0] * len(prompts)

    def go(i):
        c = StreamClient(
            server.grpc_url, ids=prompts[i], params={"max_tokens": n, "temperature": 0, "ignore_eos": True}
        )
        stamps = []
        r = c.result
        while r.finish_reason is None and r.error is None:
            k = len(r.ids)
            c.read(until_tokens=k + 1)
            stamps += [time.monotonic()] * (len(r.ids) - k)
        c.close()
        tpots[i] = (stamps[-1] - stamps[0]) / (len(stamps) - 1)

    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return statistics.mean(tpots)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args()
    engine = Engine("smollm2", kv_tokens=16384)
    base = engine.tokenizer.encode("A short history of the printing press and its effect on science. " * 40)
    prompts = {b: [base[i : i + 32] for i in range(b)] for b in a.batches}
    offline = {b: offline_step_time(engine, prompts[b], a.new_tokens) for b in a.batches}
    server = Server("--kv-tokens", "16384", name="perf")
    try:
        rows = [(b, served_tpot(server, prompts[b], a.new_tokens), offline[b]) for b in a.batches]
    finally:
        server.stop()
    print(f"{'batch':>5} {'served ms/token':>16} {'offline step ms':>16} {'ratio':>6}")
    for b, served, off in rows:
        print(f"{b:>5} {served * 1e3:>16.1f} {off * 1e3:>16.1f} {served / off:>6.2f}")


if __name__ == "__main__":
    main()
