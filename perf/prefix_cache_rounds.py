"""The offline scheduler's bookkeeping (admission, prefix matching, KV allocation with eviction, release into the
radix cache) over rounds of requests, without a model: prefill's work pattern under sustained load.

    python -m perf.prefix_cache_rounds [--pool 131072] [--requests 256] [--rounds 60]

Each round admits --requests distinct prompts under a shared preamble and finishes each after its first token,
as prefill does, so the cache gains every prompt's distinct part and fills after some rounds. The reference is
the same run's rounds before the cache is full: from then on every allocation evicts, and the report gives the
time per round of both and their ratio. Pure Python: the number is CPU time of the scheduler alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

from backends.common.core.kv_pool import KVPool
from backends.common.core.request import InferReq, SamplingParams
from backends.common.core.scheduler import Scheduler


def run_round(s: Scheduler, r: int, n: int, first_id: int) -> float:
    preamble = list(range(1000, 1015))
    for i in range(n):
        ids = preamble + [2000 + r % 50, 3000 + r, 4000 + i, 5000 + (i * 7 + r) % 997] + list(range(6000, 6018))
        s.add(InferReq(f"r{first_id + i}", ids, SamplingParams(max_tokens=1)))
    t = time.perf_counter()
    while s.has_work():
        plan = s.schedule()
        s.after_forward(plan)
        for span in plan:
            if span.samples:
                span.req.output_ids.append(7)
                s.finish(span.req, "length")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", type=int, default=131072, help="prefill's KV pool (its GPU default)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=60)
    a = ap.parse_args()
    s = Scheduler(KVPool(a.pool), max_batch=64, chunk_size=512, max_batch_tokens=4096)
    filling, full = [], []
    for r in range(a.rounds):
        was_full = s.pool.num_free < a.requests * 40  # this round's prompts cannot fit without evicting
        dt = run_round(s, r, a.requests, r * a.requests)
        (full if was_full else filling).append(dt)
    print(f"prefix cache of {a.pool} slots, {a.requests} requests a round, {a.rounds} rounds, "
          f"{len(s.radix.evictable_leaves)} cached sequences at the end")  # fmt: skip
    if filling and full:
        f, g = statistics.median(filling), statistics.median(full)
        print(f"median bookkeeping per round: {f * 1e3:.1f} ms while the cache fills ({len(filling)} rounds), "
              f"{g * 1e3:.1f} ms once it is full ({len(full)} rounds): {g / f:.1f} x")  # fmt: skip


if __name__ == "__main__":
    main()
