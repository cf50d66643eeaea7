"""y = x @ w.T for a few rows of x (decode at small batch), in Triton: one program per BLOCK_N output columns reads
its rows of w once, in BLOCK_K pieces, for every row of x. No split over K, so no second pass to reduce partial
sums (cuBLAS splits K for some of these shapes and adds a reduce kernel). Rows up to 64 (tensor-core tiles of 16, 32
or 64 rows); more go to cuBLAS."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pdl import enter, launch

MAX_ROWS = 64
TUNE_ROWS = 64  # decode graphs of up to this many rows choose between cuBLAS and skinny_linear (`tune`)

# settings worth trying, from perf/linear_sweep.py on an H200 (Llama-3.1-8B projections); the narrow column blocks
# give outputs of 2,048 columns (small models' o/out/down projections) more programs than the H200 has SMs
CANDIDATES = {
    "one row": [
        dict(block_n=16, block_k=512, num_warps=8, num_stages=4, dot=False),
        dict(block_n=16, block_k=512, num_warps=8, num_stages=3, dot=False),
        dict(block_n=16, block_k=256, num_warps=4, num_stages=4, dot=False),
        dict(block_n=8, block_k=512, num_warps=4, num_stages=4, dot=False),
        dict(block_n=4, block_k=512, num_warps=2, num_stages=4, dot=False),
    ],
    "more rows": [
        dict(block_n=64, block_k=256, num_warps=4, num_stages=4, dot=True),
        dict(block_n=64, block_k=256, num_warps=4, num_stages=3, dot=True),
        dict(block_n=32, block_k=256, num_warps=4, num_stages=4, dot=True),
        dict(block_n=32, block_k=512, num_warps=4, num_stages=4, dot=True),
    ],
    "many rows": [  # 17..64 rows: tiles of 32 or 64 rows
        dict(block_n=64, block_k=128, num_warps=4, num_stages=4, dot=True),
        dict(block_n=32, block_k=128, num_warps=4, num_stages=5, dot=True),
        dict(block_n=128, block_k=64, num_warps=4, num_stages=4, dot=True),
        dict(block_n=16, block_k=256, num_warps=4, num_stages=4, dot=True),
    ],
}
# K split in parts, for outputs of few columns (2,048-column projections of hidden-2,048 models), where one program
# per column block leaves each program a long serial loop over K
SPLIT_CANDIDATES = {
    "one row": [
        dict(block_n=16, block_k=256, num_warps=4, num_stages=4, dot=False, splits=2),
        dict(block_n=16, block_k=256, num_warps=4, num_stages=4, dot=False, splits=4),
        dict(block_n=32, block_k=256, num_warps=4, num_stages=4, dot=False, splits=4),
        dict(block_n=8, block_k=512, num_warps=4, num_stages=4, dot=False, splits=2),
        dict(block_n=16, block_k=512, num_warps=8, num_stages=3, dot=False, splits=2),
        dict(block_n=16, block_k=128, num_warps=4, num_stages=4, dot=False, splits=8),
    ],
    "more rows": [
        dict(block_n=32, block_k=256, num_warps=4, num_stages=4, dot=True, splits=2),
        dict(block_n=64, block_k=256, num_warps=4, num_stages=3, dot=True, splits=2),
        dict(block_n=32, block_k=128, num_warps=4, num_stages=4, dot=True, splits=4),
    ],
    "many rows": [
        dict(block_n=32, block_k=128, num_warps=4, num_stages=5, dot=True, splits=2),
        dict(block_n=64, block_k=128, num_warps=4, num_stages=4, dot=True, splits=2),
        dict(block_n=32, block_k=128, num_warps=4, num_stages=4, dot=True, splits=4),
        dict(block_n=16, block_k=256, num_warps=4, num_stages=4, dot=True, splits=2),
    ],
}


def _kind(rows: int) -> str:
    return "one row" if rows == 1 else ("more rows" if rows <= 16 else "many rows")


@triton.jit
def _skinny_kernel(
    X, W, Y, P, C, M, N, K, k_split, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr, SPLITS: tl.constexpr,
    GATED: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (column block, K split). With SPLITS > 1 each writes its float32 partial sums to P [SPLITS, M, N],
    and the last of a column block's programs to finish (counted in C, which it resets to 0 for the next launch)
    adds them in split order, so the result does not depend on which finished last. GATED: x's row is
    [gate | up] of width 2K and the input is silu(gate) * up, rounded as kernels.act.silu_mul rounds it."""
    pid, ps = tl.program_id(0), tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = ps * k_split
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    w_ptr = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    enter(PDL)
    if DOT:  # tensor cores over x padded to BLOCK_M rows
        offs_m = tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        x_ptr = X + offs_m[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k_split, BLOCK_K):
            x = tl.load(x_ptr + k0, mask=mask_m[:, None], other=0.0)
            if GATED:
                u = tl.load(x_ptr + K + k0, mask=mask_m[:, None], other=0.0)
                g = x.to(tl.float32)
                x = ((g / (1.0 + tl.exp(-g))).to(u.dtype).to(tl.float32) * u.to(tl.float32)).to(u.dtype)
            w = tl.load(w_ptr + k0, mask=mask_n[:, None], other=0.0)
            acc += tl.dot(x, tl.trans(w))
        offs_y = offs_m[:, None] * stride_ym + offs_n[None, :]
        offs_p = offs_m[:, None] * N + offs_n[None, :]
        mask_y = mask_m[:, None] & mask_n[None, :]
    else:  # one row: products summed along K at the end
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, k_split, BLOCK_K):
            x = tl.load(X + k0 + offs_k)
            if GATED:
                u = tl.load(X + K + k0 + offs_k)
                g = x.to(tl.float32)
                x = ((g / (1.0 + tl.exp(-g))).to(u.dtype).to(tl.float32) * u.to(tl.float32)).to(u.dtype)
            w = tl.load(w_ptr + k0, mask=mask_n[:, None], other=0.0)
            acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
        acc = tl.sum(acc2, 1)
        offs_y = offs_n
        offs_p = offs_n
        mask_y = mask_n
    if SPLITS == 1:
        tl.store(Y + offs_y, acc.to(Y.dtype.element_ty), mask=mask_y)
    else:
        part = M * N  # P is [SPLITS, M, N] with rows of N
        tl.store(P + ps * part + offs_p, acc, mask=mask_y)
        done = tl.atomic_add(C + pid, 1, sem="acq_rel")  # releases this program's partials, acquires the others'
        if done == SPLITS - 1:
            total = tl.load(P + offs_p, mask=mask_y, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLITS):
                total += tl.load(P + s * part + offs_p, mask=mask_y, other=0.0, cache_modifier=".cg")
            tl.store(Y + offs_y, total.to(Y.dtype.element_ty), mask=mask_y)
            tl.atomic_xchg(C + pid, 0)


# per (device, stream): the zeroed arrival counters of split launches (each launch leaves them at 0 again); made
# outside graph capture (the first launch on a stream is a warm-up or a tuning run) and kept for the process's life,
# since captured graphs hold their address
_COUNTERS: dict[tuple, torch.Tensor] = {}
MAX_COLUMN_BLOCKS = 1 << 14


def _counters(device: torch.device) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    c = _COUNTERS.get(key)
    if c is None:
        assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), "split launch first in a capture"
        c = _COUNTERS[key] = torch.zeros(MAX_COLUMN_BLOCKS, dtype=torch.int32, device=device)
    return c


def skinny_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor | None = None,
    block_n: int = 32,
    block_k: int = 256,
    num_warps: int = 4,
    num_stages: int = 4,
    dot: bool | None = None,
    splits: int = 1,
    gated: bool = False,
) -> torch.Tensor:
    """x: [M, K] with M <= 64, w: [N, K], both with unit stride along K, K a multiple of block_k * splits.
    Returns [M, N]. dot: tensor cores (default for M > 1) or plain products (default for M == 1). splits: K cut in
    that many parts, each its own program (more programs in flight for outputs of few columns), added in a fixed
    order. gated: x is [M, 2K] = [gate | up] and the input is silu(gate) * up (kernels.act.silu_mul fused)."""
    M, K = x.shape
    if gated:
        K //= 2
    N = w.shape[0]
    assert M <= MAX_ROWS and K % (block_k * splits) == 0 and x.stride(1) == 1 and w.stride(1) == 1, (x.shape, w.shape)
    assert w.shape[1] == K, (x.shape, w.shape, gated)
    if out is None:
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    dot = M > 1 if dot is None else dot
    if not dot:
        assert M == 1
    grid = (triton.cdiv(N, block_n), splits)
    if splits > 1:
        assert grid[0] <= MAX_COLUMN_BLOCKS and out.stride(1) == 1
        part, counters = torch.empty(splits, M, N, device=x.device, dtype=torch.float32), _counters(x.device)
    else:
        part = counters = out
    _skinny_kernel[grid](
        x, w, out, part, counters, M, N, K, K // splits, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot, SPLITS=splits,
        GATED=gated, num_warps=num_warps, num_stages=num_stages, **launch(x),
    )  # fmt: skip
    return out


def linear(x: torch.Tensor, w: torch.Tensor, settings: dict | None) -> torch.Tensor:
    """skinny_linear with `settings` (its keyword arguments) when given, else cuBLAS (F.linear)."""
    if settings is None:
        return F.linear(x, w)
    return skinny_linear(x, w, **settings)


def gated_linear(gate_up: torch.Tensor, w: torch.Tensor, settings: dict | None) -> torch.Tensor:
    """silu(gate) * up of gate_up = [gate | up], times w.T: one skinny_linear launch where `settings` say gated,
    else kernels.act.silu_mul and then `linear`."""
    if settings is not None and settings.get("gated"):
        return skinny_linear(gate_up, w, **settings)
    from kernels.act import silu_mul

    return linear(silu_mul(gate_up), w, settings)


def graph_time(fn, reps: int = 20) -> float:
    """Seconds per replay of a CUDA graph holding fn() (run once outside the capture first, which compiles)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps / 1e3


def tune(weights: list[torch.Tensor], rows: int, gated: bool = False) -> tuple[dict | None, dict]:
    """The fastest way to multiply `rows` rows by each of `weights` (one projection of every layer, all the same
    shape): None for cuBLAS, or skinny_linear's settings. Each candidate is timed as a CUDA graph running all the
    weights in turn, as a decode graph does, so launch overheads and L2 behave as they will. gated: the input is
    [gate | up] (`gated_linear`), cuBLAS timed with silu_mul before it and skinny_linear with it fused (a chosen
    setting says gated=True). Returns (choice, {description: seconds per weight, or the error of a setting that did
    not run}). 16-bit weights only: the kernel's float32 products would round through TF32."""
    N, K = weights[0].shape
    if weights[0].dtype not in (torch.bfloat16, torch.float16):
        return None, {}
    x = torch.randn(rows, 2 * K if gated else K, device=weights[0].device, dtype=weights[0].dtype)
    out = torch.empty(rows, N, device=x.device, dtype=x.dtype)
    times = {"cublas": graph_time(lambda: [gated_linear(x, w, None) if gated else F.linear(x, w) for w in weights],
                                  10) / len(weights)}  # fmt: skip
    extra = dict(gated=True) if gated else {}
    settings = [dict(s, **extra) for s in CANDIDATES[_kind(rows)] + SPLIT_CANDIDATES[_kind(rows)]]
    settings = [s for s in settings if K % (s["block_k"] * s.get("splits", 1)) == 0]
    run = lambda s: [skinny_linear(x, w, out=out, **s) for w in weights]  # noqa: E731
    return fastest(settings, run, len(weights), None, times["cublas"], times)


def fastest(settings: list[dict], run, per: int, best=None, best_t: float = float("inf"), times=None):
    """Each setting's run(setting) timed as a CUDA graph (seconds per weight: the replay over `per`); a setting that
    does not run (e.g. triton's OutOfResources: more shared memory than there is) is recorded with its error.
    Returns (the fastest setting, or `best` when none beats `best_t`; {str(setting): seconds or error})."""
    times = {} if times is None else times
    for s in settings:
        try:
            t = graph_time(lambda s=s: run(s), 10) / per
        except Exception as e:
            times[str(s)] = repr(e)[:200]
            continue
        times[str(s)] = t
        if t < best_t:
            best, best_t = s, t
    return best, times
