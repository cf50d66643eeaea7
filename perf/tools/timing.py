"""The benchmarks' one timing module: every GPU time in perf/ comes from here, so "seconds per call" means the same
thing in every report.

- `cuda_series` / `cuda_time`: CUDA events around back-to-back calls (launch overhead included where the calls
  leave the GPU idle): the steady rate of a loop of calls, what a serving loop sees.
- `cuda_median`: the median of single calls, each between its own pair of events: one call's latency, robust to
  an outlier (a compile, a clock change).
- `graph_time`: `reps` replays of one CUDA graph holding fn() (`kernels.linear.graph_time`): the GPU time alone,
  no launch overhead, what the engine's captured steps see.
- `unrolled_graph_time`: `reps` calls captured in one CUDA graph, replayed once: a small kernel's GPU time without
  even a replay's launch between calls.
- `wall_median`: the same as `cuda_median` with the host's clock, for CPU runs.
- `copy_bandwidth` and `matmul_rate`: the card's memory and bf16 tensor-core references that the rooflines divide
  by, measured in the same run as what they judge.
"""

from __future__ import annotations

import time

import torch

from kernels.linear import capture_graph, graph_time

__all__ = ["capture_graph", "copy_bandwidth", "cuda_median", "cuda_series", "cuda_time", "graph_time",
           "matmul_rate", "unrolled_graph_time", "wall_median"]  # fmt: skip


def cuda_series(fn, reps: int, series: int = 1, warmup: int = 1) -> list[float]:
    """Seconds per call of fn in each of `series` back-to-back series of `reps` calls, CUDA events around each
    series, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(series + 1)]
    torch.cuda.synchronize()
    events[0].record()
    for e in events[1:]:
        for _ in range(reps):
            fn()
        e.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) / 1e3 / reps for a, b in zip(events, events[1:])]


def cuda_time(fn, reps: int, warmup: int = 1) -> float:
    """Seconds per call of fn: CUDA events around `reps` back-to-back calls, after `warmup` untimed calls."""
    return cuda_series(fn, reps, 1, warmup)[0]


def cuda_median(fn, reps: int, warmup: int = 2) -> float:
    """Median seconds of one call of fn, each call between its own CUDA events, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def unrolled_graph_time(fn, reps: int) -> float:
    """GPU seconds per call of fn: `reps` calls captured in one CUDA graph and replayed once (after one replay)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def wall_median(fn, reps: int, warmup: int = 1) -> float:
    """Median seconds of one call of fn by the host's clock (CPU runs), after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(gib: int = 2, reps: int = 10) -> float:
    """Bytes read + written per second by a device-to-device copy of `gib` GiB (the memory roofline)."""
    src = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), reps, warmup=3)
    return 2 * src.numel() / t


def matmul_rate(n: int = 8192) -> float:
    """bf16 FLOP/s of an n x n x n cuBLAS matmul (the compute roofline)."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / cuda_time(lambda: a @ b, 10)
