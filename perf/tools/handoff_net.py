"""KV hand-off over the network transport (`kv_transport.dist`) against the backend's own send/recv of the same
bytes, measured in the same run between the same two processes.

This process plays decode: a `DistSink` over a pool on --dst-device. A spawned process plays prefill: a `KVSource`
over its own pool on --src-device. For each size, a transfer is `expect` -> prefill gathers the rows of random
slots and sends them (header through the store, one payload) -> decode writes them into random slots ->
`landed`. The reference is a bare `send`/`recv` of a tensor of the same byte count on a second two-rank group of
the same backend between the same processes. Both are timed here, from the command to the data being in place
(median of --reps).

    python perf/handoff.py net --backend nccl --src-device cuda:1 --dst-device cuda:0   # two GPUs
    python perf/handoff.py net --backend gloo                                         # CPU loopback
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from perf.tools.limits import bounded_report


def prefill_side(port: int, backend: str, device: str, shape: dict, cmds, acks) -> None:
    import torch.distributed as dist

    from backends.common.model.kv_store import KVStore
    from backends.common.transfer.kv_transport import KVSource, _process_group

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    src = KVStore.allocate(shape["layers"], shape["slots"], shape["heads"], shape["dim"], shape["dtype"], dev)
    mark = (torch.arange(shape["slots"], device=dev) % 251).to(shape["dtype"])  # exact in bf16: slot s holds s % 251
    src.buffer.copy_(mark.view(1, 1, -1, 1, 1).expand_as(src.buffer))
    source = KVSource("bench-prefill", dev)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    raw = _process_group(backend, dist.PrefixStore("raw", store), 0, dev)
    acks.put("ready")
    while (cmd := cmds.get()) is not None:
        if cmd[0] == "xfer":
            _, handle, rid, src_slots, dst_slots = cmd
            source.send(rid, 0, handle, src.buffer, src_slots, dst_slots)
        else:  # ("raw", nbytes): the backend's own send of the same bytes
            buf = torch.empty(cmd[1], dtype=torch.uint8, device=dev if backend == "nccl" else "cpu")
            raw.send([buf], 1, 0).wait()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        acks.put("sent")
    source.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["nccl", "gloo"], default="gloo")
    ap.add_argument("--src-device", default="cpu", help="prefill's pool (cuda:N or cpu)")
    ap.add_argument("--dst-device", default="cpu", help="decode's pool (cuda:N or cpu)")
    ap.add_argument("--model", default="random:llama3.1-8b", help="KV row shape (layers, KV heads, head dim)")
    ap.add_argument("--layers", type=int, default=0, help="override the layer count (smaller rows on a CPU)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--limit", type=float, default=480.0, help="wall-clock bound in seconds")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import torch.distributed as dist

    from backends.common.model import loader
    from backends.common.model.kv_store import KVStore
    from backends.common.transfer.kv_transport import DistSink, _process_group

    cfg = loader.load_config(loader.resolve(a.model))
    dtype = torch.bfloat16 if "cuda" in a.dst_device else torch.float32
    layers = a.layers or cfg.num_layers
    shape = {"layers": layers, "slots": max(a.tokens) * 2, "heads": cfg.num_kv_heads, "dim": cfg.head_dim,
             "dtype": dtype}  # fmt: skip
    row_bytes = layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    dst_dev = torch.device(a.dst_device)
    if dst_dev.type == "cuda":
        torch.cuda.set_device(dst_dev)
    dst = KVStore.allocate(layers, shape["slots"], cfg.num_kv_heads, cfg.head_dim, dtype, dst_dev)
    sink = DistSink(dst, None, "bench-decode", a.backend, "127.0.0.1", log=lambda m: None)
    where = (torch.cuda.get_device_name(dst_dev) if dst_dev.type == "cuda" else "CPU") + (
        f", prefill on {a.src_device}, decode on {a.dst_device}"
    )
    rows: list[dict] = []
    lines = [
        f"# KV hand-off over the network transport ({a.backend}; {where})",
        "",
        f"Command: `python perf/handoff.py net {' '.join(sys.argv[1:] if argv is None else argv)}`. {a.model} KV "
        f"rows ({layers} layers x K,V, {str(dtype).split('.')[-1]}: {row_bytes} bytes per token). Transfer: "
        "header through the rendezvous store, rows gathered from random slots, one payload, written into random "
        f"slots of decode's pool. Reference: `{a.backend}` send/recv of the same bytes between the same processes. "
        f"Median of {a.reps}, after one warm-up.",
        "",
        "| tokens | MB | transport ms | transport GB/s | bare ms | bare GB/s | transport / bare | rows equal |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    write, timer = bounded_report(lines, a.out, rows, a.limit)
    ctx = mp.get_context("spawn")
    cmds, acks = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=prefill_side, args=(sink.port, a.backend, a.src_device, shape, cmds, acks),
                       daemon=True)  # fmt: skip
    proc.start()
    try:
        raw = _process_group(a.backend, dist.PrefixStore("raw", sink._client()), 1, dst_dev)
        assert acks.get(timeout=120) == "ready"
        g = torch.Generator().manual_seed(0)
        for n in a.tokens:
            nbytes = n * row_bytes
            t_x, t_r, equal = [], [], True
            for rep in range(a.reps + 1):
                s_slots = torch.randperm(shape["slots"], generator=g)[:n].tolist()
                d_slots = torch.randperm(shape["slots"], generator=g)[:n].tolist()
                exp = sink.expect(f"r{n}-{rep}", 0, d_slots, -1)
                t0 = time.perf_counter()
                cmds.put(("xfer", exp.kv_handle, exp.rid, s_slots, d_slots))
                if not sink.landed(exp, 120):
                    raise RuntimeError(f"{n} tokens did not land in 120 s")
                dt = time.perf_counter() - t0
                sink.forget(exp)
                acks.get(timeout=60)
                buf = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev if a.backend == "nccl" else "cpu")
                t1 = time.perf_counter()
                cmds.put(("raw", nbytes))
                raw.recv([buf], 0, 0).wait()
                if dst_dev.type == "cuda":
                    torch.cuda.synchronize(dst_dev)
                dr = time.perf_counter() - t1
                acks.get(timeout=60)
                if rep:  # the first of each size is the warm-up
                    t_x.append(dt)
                    t_r.append(dr)
                got = dst.buffer[:, :, d_slots[:256]].float().amax(dim=(0, 1, 3, 4)).cpu()
                want = torch.tensor([s % 251 for s in s_slots[:256]], dtype=torch.float32)
                equal &= bool(torch.equal(got, want)) and bool(
                    torch.equal(dst.buffer[:, :, d_slots[:256]].float().amin(dim=(0, 1, 3, 4)).cpu(), want)
                )  # every row is its source row, in its slot
            mx, mr = statistics.median(t_x), statistics.median(t_r)
            rows.append({"tokens": n, "bytes": nbytes, "transport_s": mx, "bare_s": mr})
            lines.append(
                f"| {n} | {nbytes / 1e6:.1f} | {mx * 1e3:.2f} | {nbytes / mx / 1e9:.2f} | {mr * 1e3:.2f} | "
                f"{nbytes / mr / 1e9:.2f} | {mr / mx:.2f} | {'yes' if equal else 'NO'} |"
            )
            print(lines[-1], flush=True)
    finally:
        cmds.put(None)
        proc.join(timeout=30)
        sink.close()
        timer.cancel()
    write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
