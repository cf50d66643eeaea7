"""Decode attention at the layout's shape (B=32, H=16, Hkv=2, D=256, ctx 1024) alone: pool slot-major (as served)
vs head-major (a permuted view: each kv head's rows contiguous), contiguous vs shuffled table, one or two kv heads a
program; 12 layers' pools in one graph, us per layer against the K/V bytes at copy bandwidth."""

import sys

import torch

sys.path.insert(0, ".")  # run from the project root at commit 2fc0f51
from kernels import attention
from kernels.linear import graph_time
from perf.hybrid_bench import copy_bandwidth

B, H, HKV, D, CTX, LAYERS = int(sys.argv[1]) if len(sys.argv) > 1 else 32, 16, 2, 256, 1024, 12
dev = "cuda"
bw = copy_bandwidth()
slots = B * CTX + 64
kv_bytes = 2 * B * CTX * HKV * D * 2
print(
    f"B={B} copy {bw / 1e9:.0f} GB/s; K/V per layer {kv_bytes / 1e6:.1f} MB -> {kv_bytes / bw * 1e6:.1f} us", flush=True
)
gen = torch.Generator(device=dev).manual_seed(0)
slot_major = [[torch.randn(slots, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(2)] for _ in range(LAYERS)]
head_major = [
    [torch.randn(HKV, slots, D, device=dev, dtype=torch.bfloat16).permute(1, 0, 2) for _ in range(2)]
    for _ in range(LAYERS)
]
contig = torch.arange(B * CTX, device=dev, dtype=torch.int32).view(B, CTX)
shuffled = torch.randperm(B * CTX, device=dev, generator=gen).to(torch.int32).view(B, CTX)
q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
gate = torch.randn(B, H * D, device=dev, dtype=torch.bfloat16)
out = torch.empty_like(q)
rows = torch.arange(B, device=dev, dtype=torch.int32)
seq = torch.full((B,), CTX, device=dev, dtype=torch.int32)
counters = torch.zeros(B * HKV, device=dev, dtype=torch.int32)
S = lambda sp, bn, nw, ns, kvp=1: dict(num_splits=sp, block_n=bn, num_warps=nw, num_stages=ns, kv_per_program=kvp)
default = attention.decode_settings(B, HKV, D)
runs = [
    ("slot-major", slot_major, "contiguous", contig, dict(default, kv_per_program=1)),
    ("head-major", head_major, "contiguous", contig, dict(default, kv_per_program=1)),
    ("slot-major", slot_major, "shuffled", shuffled, dict(default, kv_per_program=1)),
]
sp0 = default["num_splits"]
for s in (
    S(sp0, 32, 4, 3),
    S(max(1, sp0 // 2), 32, 4, 3),
    S(2 * sp0, 16, 4, 2, 2),
    S(2 * sp0, 16, 4, 3, 2),
    S(sp0, 16, 4, 3, 2),
    S(sp0, 16, 4, 2, 2),
    S(sp0, 32, 8, 2, 2),
    S(max(1, sp0 // 2), 32, 8, 2, 2),
    S(2 * sp0, 16, 8, 2, 2),
):
    runs.append(("slot-major", slot_major, "contiguous", contig, s))
runs.append(("slot-major", slot_major, "shuffled", shuffled, S(2 * sp0, 16, 4, 2, 2)))
ref = None
for pool_name, pools, tname, table, s in runs:

    def fn(pools=pools, table=table, s=s):
        for k, v in pools:
            attention.decode_attention(q, k, v, table, rows, seq, 0.0625, out=out, counters=counters, gate=gate, **s)

    try:
        fn()
        torch.cuda.synchronize()
        if pools is slot_major and tname == "contiguous":
            if ref is None:
                ref = out.clone()
            err = (out.float() - ref.float()).abs().max().item()
        else:
            err = float("nan")
        t = graph_time(fn, 20) / LAYERS
        t2 = graph_time(fn, 20) / LAYERS
        print(
            f"{pool_name:10s} {tname:10s} {s}: {t * 1e6:.1f} / {t2 * 1e6:.1f} us per layer, "
            f"{kv_bytes / min(t, t2) / bw:.2f} of copy; max diff {err:.2e}",
            flush=True,
        )
    except Exception as e:
        print(f"{pool_name} {tname} {s}: failed {e!r:.300}", flush=True)
