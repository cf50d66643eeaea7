"""KV hand-off bandwidth between processes, as prefill writes into decode's pool: the owner (decode) allocates a
KV store on --dst-gpu and exports its CUDA IPC handle; a second process (prefill) opens it, holds its own store on
--src-gpu and copies rows for every layer with the `copy_kv` Triton kernel (`copy_rows`). Same GPU: a copy within
HBM; two GPUs: a peer copy over NVLink/PCIe.

    python perf/handoff.py ipc [--src-gpu 0] [--dst-gpu 0] [--model random:llama3.1-8b] [--tokens 2048 8192]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def prefill_side(handle: str, src_gpu: int, shape: dict, tokens: list[int], q) -> None:
    from backends.common.model.kv_store import KVStore
    from backends.common.transfer.kv_handoff import HandoffCache, copy_rows

    torch.cuda.set_device(src_gpu)
    peer = HandoffCache().open(handle)
    src = KVStore.allocate(shape["layers"], shape["slots"], shape["heads"], shape["dim"], torch.bfloat16, "cuda")
    src.buffer.normal_()
    out = []
    for n in tokens:
        g = torch.Generator().manual_seed(n)
        s_slots = torch.randperm(shape["slots"], generator=g)[:n].tolist()
        d_slots = torch.randperm(shape["slots"], generator=g)[:n].tolist()
        copy_rows(src.buffer, s_slots, peer.buffer, d_slots)  # warm-up (compiles the kernel)
        reps = 10
        t0 = time.perf_counter()
        for _ in range(reps):
            copy_rows(src.buffer, s_slots, peer.buffer, d_slots)  # synchronises before it returns
        dt = (time.perf_counter() - t0) / reps
        nbytes = n * src.bytes_per_slot
        ok = bool(torch.equal(peer.buffer[:, :, d_slots[:64]].cpu(), src.buffer[:, :, s_slots[:64]].cpu()))
        out.append({"tokens": n, "MB": nbytes / 1e6, "ms": dt * 1e3, "GBps": nbytes / dt / 1e9, "rows_equal": ok})
    q.put(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src-gpu", type=int, default=0, help="prefill's GPU")
    ap.add_argument("--dst-gpu", type=int, default=0, help="decode's GPU (owner of the pool)")
    ap.add_argument("--model", default="random:llama3.1-8b", help="KV shape source")
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from backends.common.model import loader
    from backends.common.model.kv_store import KVStore
    from backends.common.transfer.kv_handoff import export_handle

    cfg = loader.load_config(loader.resolve(a.model))
    shape = {"layers": cfg.num_layers, "slots": max(a.tokens) * 2, "heads": cfg.num_kv_heads, "dim": cfg.head_dim}
    torch.cuda.set_device(a.dst_gpu)
    dst = KVStore.allocate(shape["layers"], shape["slots"], shape["heads"], shape["dim"], torch.bfloat16, "cuda")
    handle = export_handle(dst, "handoff-bw")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=prefill_side, args=(handle, a.src_gpu, shape, a.tokens, q))
    p.start()
    rows = q.get(timeout=600)
    p.join()
    peer = torch.cuda.can_device_access_peer(a.src_gpu, a.dst_gpu) if a.src_gpu != a.dst_gpu else None
    lines = [
        f"# KV hand-off bandwidth ({torch.cuda.get_device_name(a.dst_gpu)}, {a.model} KV rows, bf16)",
        "",
        f"Command: `python perf/handoff.py ipc {' '.join(sys.argv[1:])}`. Prefill process on GPU {a.src_gpu} writes "
        f"into decode's pool on GPU {a.dst_gpu} through a CUDA IPC handle"
        + (f" (peer access: {peer})" if peer is not None else " (same GPU)")
        + f"; {shape['layers']} layers x K,V per token = {cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2} "
        "bytes. Time per hand-off includes the synchronisation before prefill answers.",
        "",
        "| tokens | MB | ms | GB/s (bytes moved once) | rows equal after copy |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['tokens']} | {r['MB']:.0f} | {r['ms']:.2f} | {r['GBps']:.0f} | {r['rows_equal']} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
        Path(a.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
