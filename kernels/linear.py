"""y = x @ w.T for a few rows of x (decode at small batch), in Triton: one program per BLOCK_N output columns reads
its rows of w once, in BLOCK_K pieces, for every row of x. No split over K, so no second pass to reduce partial
sums (cuBLAS splits K for some of these shapes and adds a reduce kernel). Rows up to 64 (tensor-core tiles of 16, 32
or 64 rows); more go to cuBLAS."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

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


def _kind(rows: int) -> str:
    return "one row" if rows == 1 else ("more rows" if rows <= 16 else "many rows")


@triton.jit
def _skinny_kernel(
    X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    w_ptr = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    if DOT:  # tensor cores over x padded to BLOCK_M rows
        offs_m = tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        x_ptr = X + offs_m[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + k0, mask=mask_m[:, None], other=0.0)
            w = tl.load(w_ptr + k0, mask=mask_n[:, None], other=0.0)
            acc += tl.dot(x, tl.trans(w))
        y_ptr = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
    else:  # one row: products summed along K at the end
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(X + k0 + offs_k)
            w = tl.load(w_ptr + k0, mask=mask_n[:, None], other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        tl.store(Y + offs_n, tl.sum(acc, 1).to(Y.dtype.element_ty), mask=mask_n)


def skinny_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor | None = None,
    block_n: int = 32,
    block_k: int = 256,
    num_warps: int = 4,
    num_stages: int = 4,
    dot: bool | None = None,
) -> torch.Tensor:
    """x: [M, K] with M <= 64, w: [N, K], both with unit stride along K, K a multiple of block_k. Returns [M, N].
    dot: tensor cores (default for M > 1) or plain products (default for M == 1)."""
    M, K = x.shape
    N = w.shape[0]
    assert M <= MAX_ROWS and K % block_k == 0 and x.stride(1) == 1 and w.stride(1) == 1, (x.shape, w.shape)
    if out is None:
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    dot = M > 1 if dot is None else dot
    if not dot:
        assert M == 1
    _skinny_kernel[(triton.cdiv(N, block_n),)](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out


def linear(x: torch.Tensor, w: torch.Tensor, settings: dict | None) -> torch.Tensor:
    """skinny_linear with `settings` (its keyword arguments) when given, else cuBLAS (F.linear)."""
    if settings is None:
        return F.linear(x, w)
    return skinny_linear(x, w, **settings)


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


def tune(weights: list[torch.Tensor], rows: int) -> tuple[dict | None, dict]:
    """The fastest way to multiply `rows` rows by each of `weights` (one projection of every layer, all the same
    shape): None for cuBLAS, or skinny_linear's settings. Each candidate is timed as a CUDA graph running all the
    weights in turn, as a decode graph does, so launch overheads and L2 behave as they will. Returns (choice,
    {description: seconds per weight, or the error of a setting that did not run}). 16-bit weights only: the
    kernel's float32 products would round through TF32."""
    N, K = weights[0].shape
    if weights[0].dtype not in (torch.bfloat16, torch.float16):
        return None, {}
    x = torch.randn(rows, K, device=weights[0].device, dtype=weights[0].dtype)
    out = torch.empty(rows, N, device=x.device, dtype=x.dtype)
    times = {"cublas": graph_time(lambda: [F.linear(x, w) for w in weights], 10) / len(weights)}
    best, best_t = None, times["cublas"]
    for s in CANDIDATES[_kind(rows)]:
        if K % s["block_k"]:
            continue
        try:
            t = graph_time(lambda s=s: [skinny_linear(x, w, out=out, **s) for w in weights], 10) / len(weights)
        except Exception as e:  # e.g. triton's OutOfResources: this setting needs more shared memory than there is
            times[str(s)] = repr(e)[:200]
            continue
        times[str(s)] = t
        if t < best_t:
            best, best_t = s, t
    return best, times
