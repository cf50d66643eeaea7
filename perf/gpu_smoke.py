"""GPU smoke check (groundwork for the GPU issue): the CUDA IPC KV hand-off between two processes, and the plain
PyTorch path's decode step time for a random-weight Llama-3.1-8B shape in bf16 (no Triton kernels, no CUDA graphs
yet: this is the baseline they must beat).

    python perf/gpu_smoke.py [--batches 1 32] [--context 1024]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.multiprocessing as mp


def writer(handle_json: str, slots: list[int], q) -> None:
    from backends.common.transfer.kv_handoff import HandoffCache

    peer = HandoffCache().open(handle_json)
    peer.buffer[:, :, slots] = 7.0
    torch.cuda.synchronize()
    q.put("written")


def check_ipc() -> str:
    from backends.common.model.kv_store import KVStore
    from backends.common.transfer.kv_handoff import export_handle

    store = KVStore.allocate(2, 64, 2, 8, torch.bfloat16, "cuda")
    handle = export_handle(store, "smoke")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=writer, args=(handle, [3, 5, 60], q))
    p.start()
    msg = q.get(timeout=120)
    p.join()
    ok = bool((store.buffer[:, :, [3, 5, 60]] == 7).all()) and float(store.buffer.sum()) == 7.0 * 2 * 2 * 3 * 2 * 8
    return f"CUDA IPC hand-off across processes: {msg}, rows seen by the owner: {ok}"


def decode_steps(batches: list[int], context: int) -> list[str]:
    from backends.common.engine.runner import ModelRunner
    from backends.common.model.batch import Span

    out = []
    runner = ModelRunner("random:llama3.1-8b", "bfloat16", "cuda", kv_tokens=max(batches) * (context + 8))
    cfg = runner.cfg
    weight_bytes = sum(t.numel() * t.element_size() for t in runner.model.w.values())
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        x.clone()
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 20 / (time.perf_counter() - t)
    out.append(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    for b in batches:
        spans = [Span([1], context, list(range(i * (context + 8), i * (context + 8) + context + 1))) for i in range(b)]
        for _ in range(2):
            runner.forward(spans)
        torch.cuda.synchronize()
        t = time.perf_counter()
        n = 5
        for _ in range(n):
            runner.forward(spans)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / n
        kv_bytes = b * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
        roof = (weight_bytes + kv_bytes) / bw
        out.append(
            f"decode step batch {b}, context {context}: {dt * 1e3:.1f} ms; roofline {roof * 1e3:.2f} ms "
            f"({dt / roof:.1f}x)"
        )
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=1024)
    a = ap.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    print(check_ipc(), flush=True)
    for line in decode_steps(a.batches, a.context):
        print(line, flush=True)


if __name__ == "__main__":
    main()
