"""Each Triton kernel against its PyTorch reference (kernels.reference), in bf16, over several shapes.

Needs a CUDA GPU and triton; skipped otherwise. TRITON_PD_KERNEL_DEVICE=cpu with TRITON_INTERPRET=1 runs the same
checks through Triton's interpreter on the CPU in float32 (the interpreter mishandles bf16; for developing without a
GPU)."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
DEVICE = os.environ.get("TRITON_PD_KERNEL_DEVICE", "cuda")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from kernels import attention, kv, norm, reference, rope  # noqa: E402

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def make_pool(num_slots, hkv, d, gen):
    k = torch.randn(num_slots, hkv, d, generator=gen).to(DEVICE, BF16)
    v = torch.randn(num_slots, hkv, d, generator=gen).to(DEVICE, BF16)
    return k, v


def make_table(lens, num_slots, max_ctx, gen):
    """Rows 1..n hold random distinct slots (row 0 stays unused, as the runner keeps it for padding)."""
    table = torch.zeros(len(lens) + 1, max_ctx, dtype=torch.int32)
    perm = torch.randperm(num_slots, generator=gen)
    used = 0
    for i, n in enumerate(lens):
        table[i + 1, :n] = perm[used : used + n].int()
        used += n
    return table.to(DEVICE)


def close(a, b, atol=2e-2, rtol=2e-2):
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "lens,heads,kv_heads,d,splits",
    [
        ([1, 7, 64, 300], 8, 2, 64, None),
        ([1024] * 3, 32, 8, 128, 8),
        ([5, 129, 1000], 9, 3, 64, 1),
        ([33], 4, 4, 128, 16),
    ],
)
def test_decode_attention(lens, heads, kv_heads, d, splits):
    gen = torch.Generator().manual_seed(len(lens) * 7 + heads)
    num_slots = sum(lens) + 16
    k_pool, v_pool = make_pool(num_slots, kv_heads, d, gen)
    table = make_table(lens, num_slots, max(lens) + 8, gen)
    B = len(lens)
    q = torch.randn(B, heads, d, generator=gen).to(DEVICE, BF16)
    rows = torch.arange(1, B + 1, dtype=torch.int32, device=DEVICE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    counters = torch.zeros(B * kv_heads, dtype=torch.int32, device=DEVICE)
    ref = reference.decode_attention(q, k_pool, v_pool, table, rows, seq, scale)
    for _ in range(2):  # the same counters twice, as graph replays use them: the merging split leaves them zeroed
        got = attention.decode_attention(
            q, k_pool, v_pool, table, rows, seq, scale, num_splits=splits, counters=counters
        )
        close(got, ref)
        assert not counters.any()


@pytest.mark.parametrize(
    "lens,heads,kv_heads,d,splits",
    [([1, 7, 64, 300], 8, 2, 64, None), ([1024, 65, 128], 32, 8, 128, 16), ([2, 129], 9, 3, 64, 1)],
)
def test_decode_attention_fused_rope_store(lens, heads, kv_heads, d, splits):
    """rope=(...) gives what rope_store_kv_ followed by decode_attention gives: the same output, the new token's
    rotated k and its v in the pool at its slot, no other slot touched, q and k left as they were."""
    gen = torch.Generator().manual_seed(sum(lens) + d)
    num_slots = sum(lens) + 16
    k_pool, v_pool = make_pool(num_slots, kv_heads, d, gen)
    table = make_table(lens, num_slots, max(lens) + 8, gen)
    B = len(lens)
    qkv = torch.randn(B, heads + 2 * kv_heads, d, generator=gen).to(DEVICE, BF16)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope.rope_cache(inv_freq, 2048, DEVICE)
    rows = torch.arange(1, B + 1, dtype=torch.int32, device=DEVICE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    pos = (seq - 1).long()
    out_slots = table[rows.long(), pos].clone()
    scale = d**-0.5
    # reference: rotate, store, attend
    q2, k2, kp2, vp2 = q.clone(), k.clone(), k_pool.clone(), v_pool.clone()
    reference.apply_rope_(q2, k2, pos, cos, sin)
    reference.store_kv(k2, v.clone(), kp2, vp2, out_slots)
    ref = reference.decode_attention(q2, kp2, vp2, table, rows, seq, scale)
    # the pool's entries at the new slots hold garbage before the fused kernel writes them
    k_pool[out_slots.long()] = 7.0
    v_pool[out_slots.long()] = -7.0
    before = qkv.clone()
    counters = torch.zeros(B * kv_heads, dtype=torch.int32, device=DEVICE)
    got = attention.decode_attention(
        q, k_pool, v_pool, table, rows, seq, scale, num_splits=splits, counters=counters,
        rope=(k, v, cos, sin, out_slots),
    )  # fmt: skip
    close(got, ref)
    close(k_pool, kp2)
    assert torch.equal(v_pool, vp2)
    assert torch.equal(qkv, before)
    assert not counters.any()


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_attention_sigmoid_gate(splits):
    """gate= multiplies each query row's output by sigmoid of its gate columns (a strided view inside a q|gate|k|v
    projection, rows picked by q_idx) as the store writes it: what the ungated launch followed by torch.sigmoid and
    the product gives, to bf16 rounding of the sigmoid, with other rows untouched and the counters left zeroed."""
    gen = torch.Generator().manual_seed(11 + splits)
    lens, H, Hkv, D = [3, 40, 200], 8, 2, 64
    k_pool, v_pool = make_pool(300, Hkv, D, gen)
    table = make_table(lens, 300, 256, gen)
    q = torch.randn(7, H, D, generator=gen).to(DEVICE, BF16)
    qkv = torch.randn(7, 4 * H * D, generator=gen).to(DEVICE, BF16) * 4
    gate = qkv[:, H * D : 2 * H * D]
    rows = torch.tensor([1, 2, 3], dtype=torch.int32, device=DEVICE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q_idx = torch.tensor([5, 0, 3], dtype=torch.int32, device=DEVICE)
    counters = torch.zeros(len(lens) * Hkv, dtype=torch.int32, device=DEVICE)
    plain, gated = torch.zeros_like(q), torch.zeros_like(q)
    for out, g in ((plain, None), (gated, gate)):
        attention.decode_attention(q, k_pool, v_pool, table, rows, seq, 0.125, out=out, q_idx=q_idx, num_splits=splits,
                                   counters=counters, gate=g)  # fmt: skip
        assert not counters.any()
    idx = q_idx.long()
    want = plain[idx].view(3, H * D) * torch.sigmoid(gate[idx])
    got = gated[idx].view(3, H * D)
    ulp = torch.finfo(BF16).eps
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=ulp)
    if BF16 == torch.bfloat16:  # the same roundings: a rare last-bit difference of exp flips a bf16 rounding
        assert (got == want).float().mean() > 0.99
    assert gated[[1, 2, 4, 6]].abs().sum() == 0


def test_decode_attention_scattered_queries():
    """q_idx picks the query rows out of a larger ragged batch; other rows are left alone."""
    gen = torch.Generator().manual_seed(3)
    lens = [17, 90]
    k_pool, v_pool = make_pool(200, 2, 64, gen)
    table = make_table(lens, 200, 128, gen)
    q = torch.randn(6, 8, 64, generator=gen).to(DEVICE, BF16)
    out = torch.zeros_like(q)
    rows = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q_idx = torch.tensor([4, 1], dtype=torch.int32, device=DEVICE)
    attention.decode_attention(q, k_pool, v_pool, table, rows, seq, 0.125, out=out, q_idx=q_idx)
    ref = reference.decode_attention(q[[4, 1]], k_pool, v_pool, table, rows, seq, 0.125)
    close(out[[4, 1]], ref)
    assert out[[0, 2, 3, 5]].abs().sum() == 0


@pytest.mark.parametrize(
    "q_lens,prefix,heads,kv_heads,d",
    [
        ([5, 64, 130], [0, 0, 0], 8, 2, 64),
        ([1, 200, 37], [10, 300, 0], 32, 8, 128),
        ([257], [63], 9, 3, 64),
        ([3, 150], [0, 70], 16, 2, 256),
    ],  # fmt: skip
)
def test_prefill_attention(q_lens, prefix, heads, kv_heads, d):
    gen = torch.Generator().manual_seed(sum(q_lens))
    ctx = [p + n for p, n in zip(prefix, q_lens)]
    num_slots = sum(ctx) + 8
    k_pool, v_pool = make_pool(num_slots, kv_heads, d, gen)
    table = make_table(ctx, num_slots, max(ctx), gen)
    T = sum(q_lens)
    q = torch.randn(T, heads, d, generator=gen).to(DEVICE, BF16)
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]

    def i32(x):
        return torch.tensor(x, dtype=torch.int32, device=DEVICE)

    rows = torch.arange(1, len(q_lens) + 1, dtype=torch.int32, device=DEVICE)
    args = (table, rows, i32(starts), i32(q_lens), i32(ctx))
    got = attention.prefill_attention(q, k_pool, v_pool, *args, max(q_lens), d**-0.5)
    close(got, reference.prefill_attention(q, k_pool, v_pool, *args, d**-0.5))


@pytest.mark.parametrize("rows,n,with_res", [(1, 576, True), (37, 4096, True), (5, 128, False), (130, 1000, True)])
def test_add_rms_norm(rows, n, with_res):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, n, generator=gen).to(DEVICE, BF16)
    r = torch.randn(rows, n, generator=gen).to(DEVICE, BF16) if with_res else None
    w = (1 + 0.1 * torch.randn(n, generator=gen)).to(DEVICE, BF16)
    r2 = r.clone() if with_res else None
    got = norm.add_rms_norm(x, r, w, 1e-5)
    want = reference.add_rms_norm(x.clone(), r2, w, 1e-5)
    close(got, want)
    if with_res:
        close(r, r2, atol=0, rtol=0)


@pytest.mark.parametrize("T,hq,hk,d", [(1, 32, 8, 128), (77, 9, 3, 64), (300, 16, 16, 128)])
def test_rope(T, hq, hk, d):
    gen = torch.Generator().manual_seed(T)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope.rope_cache(inv_freq, 4096, DEVICE)
    qkv = torch.randn(T, hq + 2 * hk, d, generator=gen).to(DEVICE, BF16)  # q and k as views of a fused projection
    pos = torch.randint(0, 4096, (T,), generator=gen).to(DEVICE)
    q, k = qkv[:, :hq], qkv[:, hq : hq + hk]
    q2, k2 = q.clone(), k.clone()
    rope.apply_rope_(q, k, pos, cos, sin)
    reference.apply_rope_(q2, k2, pos, cos, sin)
    close(q, q2)
    close(k, k2)


@pytest.mark.parametrize("T,hq,hk,d", [(1, 32, 8, 128), (7, 14, 2, 64), (300, 16, 16, 64)])
def test_rope_store_kv(T, hq, hk, d):
    gen = torch.Generator().manual_seed(T + d)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope.rope_cache(inv_freq, 4096, DEVICE)
    qkv = torch.randn(T, hq + 2 * hk, d, generator=gen).to(DEVICE, BF16)
    pos = torch.randint(0, 4096, (T,), generator=gen).to(DEVICE)
    slots = torch.randperm(1000, generator=gen)[:T].to(DEVICE)
    kp, vp = torch.zeros(2, 1000, hk, d, dtype=BF16, device=DEVICE)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hk], qkv[:, hq + hk :]
    k_before = k.clone()
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    kp2, vp2 = kp.clone(), vp.clone()
    rope.rope_store_kv_(q, k, v, pos, cos, sin, kp, vp, slots)
    reference.apply_rope_(q2, k2, pos, cos, sin)
    reference.store_kv(k2, v2, kp2, vp2, slots)
    close(q, q2)
    close(kp, kp2)
    assert torch.equal(vp, vp2)
    assert torch.equal(k, k_before)  # k is read, not rotated in place
    untouched = torch.ones(1000, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert not kp[untouched].any() and not vp[untouched].any()


@pytest.mark.parametrize("T,hkv,d", [(1, 8, 128), (100, 3, 64), (513, 2, 128)])
def test_store_kv(T, hkv, d):
    gen = torch.Generator().manual_seed(T)
    kvv = torch.randn(T, 2 * hkv, d, generator=gen).to(DEVICE, BF16)
    k, v = kvv[:, :hkv], kvv[:, hkv:]
    kp, vp = torch.zeros(2, 1000, hkv, d, dtype=BF16, device=DEVICE)
    slots = torch.randperm(1000, generator=gen)[:T].to(DEVICE)
    kp2, vp2 = kp.clone(), vp.clone()
    kv.store_kv(k, v, kp, vp, slots)
    reference.store_kv(k, v, kp2, vp2, slots)
    close(kp, kp2, atol=0, rtol=0)
    close(vp, vp2, atol=0, rtol=0)


@pytest.mark.parametrize("layers,n,hkv,d", [(2, 1, 8, 128), (30, 77, 3, 64), (32, 1000, 8, 128)])
def test_copy_kv(layers, n, hkv, d):
    gen = torch.Generator().manual_seed(n)
    src = torch.randn(layers, 2, 1200, hkv, d, generator=gen).to(DEVICE, BF16)
    dst = torch.zeros(layers, 2, 1500, hkv, d, dtype=BF16, device=DEVICE)
    ss = torch.randperm(1200, generator=gen)[:n].to(DEVICE)
    ds = torch.randperm(1500, generator=gen)[:n].to(DEVICE)
    dst2 = dst.clone()
    kv.copy_kv(src, ss, dst, ds)
    reference.copy_kv(src, ss, dst2, ds)
    close(dst, dst2, atol=0, rtol=0)


@pytest.mark.parametrize("T,f", [(1, 14336), (33, 1536), (257, 1000)])
def test_silu_mul(T, f):
    from kernels import act

    gen = torch.Generator().manual_seed(T)
    gu = torch.randn(T, 2 * f, generator=gen).to(DEVICE, BF16)
    close(act.silu_mul(gu), reference.silu_mul(gu))


@pytest.mark.parametrize(
    "M,N,K,dot",
    [
        (1, 96, 512, False),
        (1, 70, 256, True),
        (3, 64, 768, True),
        (16, 33, 256, True),
        (40, 70, 256, True),
        (64, 32, 512, True),
        (100, 70, 256, True),
        (128, 64, 512, True),
    ],  # fmt: skip
)
def test_skinny_linear(M, N, K, dot):
    from kernels import linear

    gen = torch.Generator().manual_seed(M * N)
    x = torch.randn(M, K, generator=gen).to(DEVICE, BF16)
    w = torch.randn(N, K, generator=gen).to(DEVICE, BF16) / K**0.5
    # tiles of 128 rows take a narrower K block (as tune's "most rows" candidates): [128, 256] x 4 stages is more
    # shared memory than an H100 or H200 has
    got = linear.skinny_linear(x, w, block_n=32, block_k=64 if M > 64 else 256, dot=dot)
    close(got, (x.float() @ w.float().T).to(BF16))


@pytest.mark.parametrize(
    "M,N,K,dot,splits,gated",
    [
        (1, 96, 1024, False, 4, False),
        (1, 70, 1024, False, 2, True),
        (3, 64, 1024, True, 2, False),
        (40, 70, 512, True, 2, True),
        (128, 70, 512, True, 4, True),
        (1, 33, 512, False, 1, True),
        (1, 70, 1024, False, 2, "whole"),
    ],  # fmt: skip
)
def test_skinny_linear_split_and_gated(M, N, K, dot, splits, gated):
    """K cut in parts (the last program of a column block adds the parts, then leaves its counter at 0 for the
    next launch: the second launch must give the same bits) and silu(gate) * up fused into the input."""
    from kernels import act, linear

    gen = torch.Generator().manual_seed(M * N + splits)
    x = torch.randn(M, 2 * K if gated else K, generator=gen).to(DEVICE, BF16)
    w = torch.randn(N, K, generator=gen).to(DEVICE, BF16) / K**0.5
    settings = dict(block_n=32, block_k=128, num_stages=3, dot=dot, splits=splits, gated=gated)
    if gated == "whole":  # gated, each program's K range as one tile read before the PDL wait
        settings.update(gated=True, block_k=K // splits, preload=True, num_stages=1)
    got = linear.skinny_linear(x, w, **settings)
    again = linear.skinny_linear(x, w, **settings)
    xin = act.silu_mul(x) if gated else x
    close(got, (xin.float() @ w.float().T).to(BF16))
    assert torch.equal(got, again)
    assert all(int(c.count_nonzero()) == 0 for c in linear._COUNTERS.values())
    close(linear.gated_linear(x, w, None) if gated else linear.linear(x, w, None), got)


@pytest.mark.parametrize(
    "M,N,K,splits,glu,defer",
    [(32, 200, 512, 1, False, False), (17, 96, 512, 4, False, False), (128, 130, 1024, 2, False, True),
     (40, 140, 256, 1, True, False), (2, 64, 512, 2, False, False)],
)  # fmt: skip
def test_skinny_linear_swap(M, N, K, splits, glu, defer):
    """The product as w @ x.T (swap): near the reference and the other form's result, the same bits with the first
    weight tile preloaded and on a second launch (the split's counters left at 0); with defer, the partials add up
    to the bits the launch stores; glu gives silu(gate) * up; a prologue or glu with a K split is refused."""
    from kernels import act, linear

    gen = torch.Generator().manual_seed(M * N + splits)
    x = torch.randn(M, K, generator=gen).to(DEVICE, BF16)
    w = torch.randn(N, K, generator=gen).to(DEVICE, BF16) / K**0.5
    settings = dict(block_n=64, block_k=128, num_warps=4, num_stages=3, dot=True, splits=splits, glu=glu)
    got = linear.skinny_linear(x, w, swap=True, **settings)
    want = (x.float() @ w.float().T).to(BF16)
    if glu:
        want = act.silu_mul(want)
    close(got, want)
    close(got, linear.skinny_linear(x, w, **settings))
    assert torch.equal(linear.skinny_linear(x, w, swap=True, preload=True, **settings), got)
    assert torch.equal(linear.skinny_linear(x, w, swap=True, **settings), got)
    assert all(int(c.count_nonzero()) == 0 for c in linear._COUNTERS.values())
    if defer:
        parts = linear.skinny_linear(x, w, swap=True, defer=True, **settings)
        assert isinstance(parts, linear.Partials) and torch.equal(parts.sum(), got)
    with pytest.raises(AssertionError, match="swap"):
        ones = torch.ones(K, device=DEVICE, dtype=BF16)
        linear.skinny_linear(x, w, swap=True, norm=(None, ones, 1e-6, x), **settings)
    with pytest.raises(AssertionError, match="glu without a K split"):
        linear.skinny_linear(x, w[: N - N % 2], swap=True, **dict(settings, glu=True, splits=2))


@pytest.mark.parametrize(
    "M,splits,prologue", [(3, 1, None), (40, 2, "gated"), (20, 2, "gated"), (64, 1, None), (128, 2, None)]
)
def test_skinny_linear_preload_on_tensor_cores(M, splits, prologue):
    """More than one row (tensor cores): the first weight tile loaded before the wait for the launch before gives
    the same bits as the same settings without it (the same products in the same order), near the reference."""
    from kernels import act, linear

    K, N = 512, 96
    gen = torch.Generator().manual_seed(M + splits)
    x = torch.randn(M, 2 * K if prologue == "gated" else K, generator=gen).to(DEVICE, BF16)
    w = torch.randn(N, K, generator=gen).to(DEVICE, BF16) / K**0.5
    settings = dict(block_n=32, block_k=128, num_stages=3, dot=True, splits=splits, gated=prologue == "gated")
    plain = linear.skinny_linear(x, w, **settings)
    pre = linear.skinny_linear(x, w, preload=True, **settings)
    assert torch.equal(pre, plain)
    xin = act.silu_mul(x) if prologue == "gated" else x
    close(pre, (xin.float() @ w.float().T).to(BF16))


@pytest.mark.parametrize(
    "M,splits,prologue,extra",
    [
        (3, 1, "gated", {}),
        (40, 2, "gated", dict(preload=True)),
        (32, 4, "gated", dict(preload=True)),
        (20, 1, "norm", {}),
        (40, 2, "norm+res", dict(glu=True, norm_tile=256)),
        (100, 2, "norm+res", dict(preload=True, norm_tile=512)),
    ],
)  # fmt: skip
def test_skinny_linear_prefetch_gives_the_same_bits(M, splits, prologue, extra):
    """Tensor cores with a prologue: the input tiles loaded a step ahead (prefetch) give the same bits as the same
    settings without it (the same products in the same order), with the norm's residual stream too, and stay near
    the unfused launches; with the norm's sum of squares in tiles of norm_tile columns, near them."""
    from kernels import linear

    K, N = 512, 96
    gen = torch.Generator().manual_seed(M + 3 * splits)
    x = torch.randn(M, 2 * K if prologue == "gated" else K, generator=gen).to(DEVICE, BF16)
    res = torch.randn(M, K, generator=gen).to(DEVICE, BF16)
    x[0] *= 4  # rows of different scales: a row normed with another's sum of squares is wrong
    nw = (torch.randn(K, generator=gen) * 0.1).to(DEVICE, BF16)
    w = torch.randn(N, K, generator=gen).to(DEVICE, BF16) / K**0.5
    settings = dict(block_n=32, block_k=64 if M > 64 else 128, num_stages=3, dot=True, splits=splits, **extra)

    def launch(prefetch, settings=settings):
        if prologue == "gated":
            return linear.skinny_linear(x, w, gated=True, prefetch=prefetch, **settings), None
        r = res if prologue == "norm+res" else None
        r_out = torch.empty_like(x) if r is not None else x
        return linear.skinny_linear(x, w, norm=(r, nw, 1e-6, r_out), prefetch=prefetch, **settings), r_out

    (got, got_res), (plain, plain_res) = launch(True), launch(False)
    if "norm_tile" in extra:  # the sum of squares added in another order: near, not the same bits
        close(got, plain)
    else:
        assert torch.equal(got, plain)
    assert got_res is None or torch.equal(got_res, plain_res)
    if prologue == "gated":
        want = linear.gated_linear(x, w, None)
    else:
        want = linear.normed_linear(x, res.clone() if prologue == "norm+res" else None, nw, 1e-6, w, None)[0]
    close(got, linear.glu_after(want, None) if extra.get("glu") else want)
    with pytest.raises(AssertionError, match="prefetch"):
        linear.skinny_linear(x[:, :K].contiguous(), w, prefetch=True, block_n=32, block_k=128)


@pytest.mark.parametrize(
    "M,N,splits,prologue,offset",
    [(1, 96, 2, None, True), (3, 80, 2, "gated", False), (32, 160, 4, None, False), (40, 64, 2, "gated", True)],
)
def test_skinny_linear_deferred_partials_give_the_added_bits(M, N, splits, prologue, offset):
    """defer: a K split's partial sums come back unadded (Partials) and add_rms_norm adds them in split order: the
    same normalised rows and residual stream, bit for bit, as the split launch that adds them itself followed by
    add_rms_norm; Partials.sum() is that launch's product. No counter is touched, so the next split launch on the
    stream still finds them at 0."""
    from kernels import linear

    K = 512
    gen = torch.Generator().manual_seed(M * N + splits)
    x = torch.randn(M, 2 * K if prologue == "gated" else K, generator=gen).to(DEVICE, BF16)
    w = torch.randn(N, K, generator=gen).to(DEVICE, BF16) / K**0.5
    res = torch.randn(M, N, generator=gen).to(DEVICE, BF16)
    nw = (0.1 * torch.randn(N, generator=gen)).to(DEVICE, BF16)
    settings = dict(block_n=32, block_k=128, num_stages=3, splits=splits, dot=M > 1, gated=prologue == "gated")
    fused = {}
    added = linear.skinny_linear(x, w, **settings, **fused)
    parts = linear.skinny_linear(x, w, **settings, **fused, defer=True)
    assert isinstance(parts, linear.Partials) and tuple(parts.shape) == (M, N) and parts.parts.shape[0] == splits
    assert torch.equal(parts.sum(), added)
    r1, r2 = res.clone(), res.clone()
    want = norm.add_rms_norm(added, r1, nw, 1e-6, offset=offset)
    got = norm.add_rms_norm(parts, r2, nw, 1e-6, offset=offset)
    assert got.dtype == added.dtype and torch.equal(got, want) and torch.equal(r2, r1)
    assert torch.equal(linear.skinny_linear(x, w, **settings, **fused), added)  # counters left at 0
    with pytest.raises(AssertionError, match="defer: a K split"):
        linear.skinny_linear(x, w, **dict(settings, splits=1), **fused, defer=True)
    with pytest.raises(AssertionError, match="no defer"):
        linear.normed_linear(parts, res, nw, 1e-6, w[:, :N].contiguous(), dict(settings, norm=True))


@pytest.mark.parametrize(
    "rows,with_res,splits",
    [(1, True, 1), (1, True, 2), (1, False, 1), (3, True, 1), (20, True, 2), (40, False, 1)],
)
def test_skinny_linear_norm_prologue(rows, with_res, splits):
    """rmsnorm(x + residual) * (1 + weight) computed by every program as it reads (kernels.norm's rounding), the
    residual stream written once to a tensor of its own; against add_rms_norm and the projection. One row with
    plain products, more rows with tensor cores (each row its own sum of squares, the first row at 8 times the
    others' scale)."""
    from kernels import linear

    K, N = 1024, 200
    gen = torch.Generator().manual_seed(2 * splits + with_res + rows)
    x = torch.randn(rows, K, generator=gen).to(DEVICE, BF16)
    res = torch.randn(rows, K, generator=gen).to(DEVICE, BF16) if with_res else None
    x[0] *= 8  # rows of different scales: a row normed with another's sum of squares is wrong
    nw = (torch.randn(K, generator=gen) * 0.1).to(DEVICE, BF16)
    w = torch.randn(N, K, generator=gen).to(DEVICE, BF16) / K**0.5
    dot = rows > 1
    settings = dict(block_n=16 if rows == 1 else 32, block_k=256 if rows == 1 else 128, num_warps=4, num_stages=3,
                    dot=dot, splits=splits, norm=True)  # fmt: skip
    res_copy = None if res is None else res.clone()
    got, got_res = linear.normed_linear(x, res, nw, 1e-6, w, settings)
    want, want_res = linear.normed_linear(x, res_copy, nw, 1e-6, w, None)  # updates res_copy in place
    close(got, want)
    assert torch.equal(got_res, want_res)
    if with_res:  # the fused launch leaves the residual it read as it was
        assert got_res.data_ptr() != res.data_ptr() and not torch.equal(res, want_res)
    else:
        assert got_res is x


@pytest.mark.parametrize(
    "rows,splits,preload,norm",
    [(3, 1, False, False), (20, 2, True, False), (40, 1, True, True), (100, 2, False, True)],
)
def test_skinny_linear_glu_epilogue(rows, splits, preload, norm):
    """An MLP's gate_up with silu(gate) * up fused after the product (tensor cores): the [rows, C] result is
    kernels.act.silu_mul of the [rows, 2C] product, near the unfused launches; with the norm fused in too; the same
    bits again on a second launch (split counters left at 0); `glu_after` passes a glu launch's result through."""
    from kernels import act, linear

    K, C = 512, 80
    gen = torch.Generator().manual_seed(rows + splits)
    x, res = (torch.randn(rows, K, generator=gen).to(DEVICE, BF16) for _ in range(2))
    nw = (torch.randn(K, generator=gen) * 0.1).to(DEVICE, BF16)
    w = torch.randn(2 * C, K, generator=gen).to(DEVICE, BF16) / K**0.5
    settings = dict(block_n=32, block_k=64 if rows > 64 else 128, num_stages=3, dot=True, splits=splits,
                    preload=preload, glu=True, norm=bool(norm))  # fmt: skip
    if norm:
        got, _ = linear.normed_linear(x, res, nw, 1e-6, w, settings)
        again, _ = linear.normed_linear(x, res, nw, 1e-6, w, settings)
        want = linear.glu_after(linear.normed_linear(x, res.clone(), nw, 1e-6, w, None)[0], None)
    else:
        got, again = linear.linear(x, w, settings), linear.linear(x, w, settings)
        want = act.silu_mul((x.float() @ w.float().T).to(BF16))
    assert got.shape == (rows, C)
    close(got, want)
    assert torch.equal(got, again)
    assert all(int(c.count_nonzero()) == 0 for c in linear._COUNTERS.values())
    assert linear.glu_after(got, settings) is got


@pytest.mark.parametrize(
    "rows,splits,preload,unroll,block_k",
    [
        (1, 1, False, False, 128),
        (1, 2, True, False, 128),
        (1, 2, True, True, 128),
        (1, 2, True, False, 256),
        (1, 1, True, False, 512),
        (3, 1, False, False, 128),
        (20, 2, True, False, 128),
        (20, 1, True, False, 128),
    ],
)
def test_skinny_linear_conv_epilogue(rows, splits, preload, unroll, block_k):
    """A linear-attention in_proj: rmsnorm fused in, and each row's first C outputs through the conv step in the
    same launch (row m's state read at page pages[m], written at out_pages[m]): the outputs, the conv's float32
    outputs and the new state pages as the unfused launches give them; other pages untouched. One row with plain
    products, more rows with tensor cores. block_k * splits = K: each program's whole range of K in the one tile
    read before the PDL wait (`whole_range_candidates`)."""
    from kernels import delta_rule, linear

    K, N, C = 512, 160, 96
    gen = torch.Generator().manual_seed(splits + rows)
    x, res = (torch.randn(rows, K, generator=gen).to(DEVICE, BF16) for _ in range(2))
    nw = (torch.randn(K, generator=gen) * 0.1).to(DEVICE, BF16)
    w = torch.randn(N, K, generator=gen).to(DEVICE, BF16) / K**0.5
    cw = torch.randn(C, 4, generator=gen).to(DEVICE, BF16)
    state = torch.randn(2 * rows + 2, C, 3, generator=gen).to(DEVICE)
    # row m reads page 2m + 1 and writes page 2m + 2 (read pages written by no row: a read after another row's
    # write would show); page 0 is no row's
    pages = torch.arange(1, 2 * rows, 2, dtype=torch.int32, device=DEVICE)
    out_pages = pages + 1
    ref_state, ref_mixed = state.clone(), torch.empty(rows, C, device=DEVICE)
    mixed = torch.empty(rows, C, device=DEVICE)
    settings = dict(block_n=32, block_k=block_k, num_stages=3, dot=rows > 1, splits=splits, preload=preload,
                    norm=True, conv=True, unroll=unroll)  # fmt: skip
    got, _ = linear.normed_linear(x, res, nw, 1e-6, w, settings, conv=(cw, state, pages, out_pages, mixed))
    want, _ = linear.normed_linear(x, res.clone(), nw, 1e-6, w, None, conv=(cw, ref_state, pages, out_pages,
                                                                            ref_mixed))  # fmt: skip
    close(got, want)
    close(mixed, delta_rule.conv_step(got, cw, state.clone(), pages))  # on the outputs the launch stored
    torch.testing.assert_close(mixed, ref_mixed, atol=3e-2, rtol=3e-2)
    written = out_pages.long().cpu()
    kept = [p for p in range(state.shape[0]) if p not in set(written.tolist())]
    assert torch.equal(state[kept], ref_state[kept])
    torch.testing.assert_close(state[written], ref_state[written], atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(DEVICE != "cuda", reason="times CUDA graphs")
@pytest.mark.parametrize("rows,prologue", [(1, "norm"), (4, "norm"), (32, "norm"), (1, "silu"), (4, "silu")])
def test_tune_with_a_prologue_picks_a_setting_that_runs(rows, prologue):
    """tune with what the input is computed from (the norm and the conv step at any number of rows): whatever it
    picks gives the unfused result; at more than one row it also timed skinny_linear after the prologue's own
    launch (settings without the prologue's flag) and the fused prologue with its input loaded a step ahead."""
    from kernels import linear

    gen = torch.Generator().manual_seed(rows)
    ws = [(torch.randn(512, 1024, generator=gen) / 32).to(DEVICE, BF16) for _ in range(4)]
    choice, times = linear.tune(ws, rows, prologue, conv_channels=256 if prologue == "norm" else 0)
    assert isinstance(times["cublas"], float) and len(times) > 1
    flag = {"norm": "norm", "silu": "gated"}[prologue]
    unfused = [k for k in times if k != "cublas" and f"'{flag}': True" not in k]
    assert bool(unfused) == (rows > 1), list(times)
    assert any("'prefetch': True" in k for k in times) == (rows > 1), list(times)
    assert not any(isinstance(t, str) and "capture" in t for t in times.values()), times  # counted launches ran
    x = torch.randn(rows, 2048 if prologue == "silu" else 1024, generator=gen).to(DEVICE, BF16)
    if prologue == "norm":
        res, nw = torch.randn_like(x), (torch.randn(1024, generator=gen) * 0.1).to(DEVICE, BF16)
        cw, pages = torch.randn(256, 4, device=DEVICE).to(BF16), torch.arange(rows, dtype=torch.int32, device=DEVICE)
        got_mixed, want_mixed = torch.empty(rows, 256, device=DEVICE), torch.empty(rows, 256, device=DEVICE)
        got = linear.normed_linear(
            x,
            res.clone(),
            nw,
            1e-6,
            ws[0],
            choice,
            conv=(cw, torch.zeros(rows, 256, 3, device=DEVICE), pages, pages, got_mixed),
        )[0]
        want = linear.normed_linear(
            x,
            res.clone(),
            nw,
            1e-6,
            ws[0],
            None,
            conv=(cw, torch.zeros(rows, 256, 3, device=DEVICE), pages, pages, want_mixed),
        )[0]
        close(got, want)
        torch.testing.assert_close(got_mixed, want_mixed, atol=3e-2, rtol=3e-2)  # fmt: skip
    else:
        close(linear.gated_linear(x, ws[0], choice), linear.gated_linear(x, ws[0], None))


@pytest.mark.skipif(DEVICE != "cuda", reason="times CUDA graphs")
@pytest.mark.parametrize("rows", [1, 4, 32])
def test_tune_with_the_glu_epilogue_gives_silu_of_gate_times_up(rows):
    """tune of an MLP's normed gate_up with the glu epilogue: whatever it picks, normed_linear then glu_after give
    silu(gate) * up of the unfused launches; glu only at more than one row."""
    from kernels import linear

    gen = torch.Generator().manual_seed(rows + 7)
    ws = [(torch.randn(1024, 1024, generator=gen) / 32).to(DEVICE, BF16) for _ in range(4)]
    choice, times = linear.tune(ws, rows, "norm", epilogue="glu")
    assert isinstance(times["cublas"], float) and len(times) > 1
    assert not (choice or {}).get("glu") or rows > 1
    glu = [k for k, t in times.items() if "'glu': True" in k and isinstance(t, float)]
    assert bool(glu) == (rows > 1), list(times)
    assert not any(isinstance(t, str) and "wrong" in t for t in times.values()), times
    x, res = (torch.randn(rows, 1024, generator=gen).to(DEVICE, BF16) for _ in range(2))
    nw = (torch.randn(1024, generator=gen) * 0.1).to(DEVICE, BF16)
    got = linear.glu_after(linear.normed_linear(x, res.clone(), nw, 1e-6, ws[0], choice)[0], choice)
    want = linear.glu_after(linear.normed_linear(x, res.clone(), nw, 1e-6, ws[0], None)[0], None)
    assert got.shape == (rows, 512)
    close(got, want)


@pytest.mark.skipif(DEVICE != "cuda", reason="times CUDA graphs")
@pytest.mark.parametrize("rows,prologue", [(1, None), (32, None), (32, "silu")])
def test_tune_with_the_norm_epilogue_times_deferred_partials(rows, prologue):
    """tune of a product that an add + RMSNorm reads next (epilogue "norm"): it timed K-split settings with their
    partials left to the norm's launch (defer), and whatever it picks, the product then add_rms_norm give the
    unfused launches' rows and residual stream; a deferring pick hands the norm Partials."""
    from kernels import linear

    gen = torch.Generator().manual_seed(rows + 3)
    ws = [(torch.randn(1024, 2048, generator=gen) / 45).to(DEVICE, BF16) for _ in range(4)]
    choice, times = linear.tune(ws, rows, prologue, epilogue="norm")
    assert any("'defer': True" in k and isinstance(t, float) for k, t in times.items()), list(times)
    assert not any(isinstance(t, str) and "wrong" in t for t in times.values()), times
    x = torch.randn(rows, 4096 if prologue == "silu" else 2048, generator=gen).to(DEVICE, BF16)
    res, nw = torch.randn(rows, 1024, generator=gen).to(DEVICE, BF16), (torch.randn(1024) * 0.1).to(DEVICE, BF16)
    y = linear.prologue_linear(prologue, x, ws[0], choice)
    assert isinstance(y, linear.Partials) == bool((choice or {}).get("defer")), choice
    r1, r2 = res.clone(), res.clone()
    close(
        norm.add_rms_norm(y, r1, nw, 1e-6, offset=True),
        norm.add_rms_norm(linear.prologue_linear(prologue, x, ws[0], None), r2, nw, 1e-6, offset=True),
    )
    close(r1, r2)


@pytest.mark.skipif(DEVICE != "cuda", reason="times CUDA graphs")
def test_tune_takes_its_cached_pick_in_the_next_process(tmp_path, monkeypatch):
    """A second process (a new tuning cache on the same file) gets the first one's pick and times without timing
    anything, and the pick still gives the unfused result."""
    from kernels import linear

    gen = torch.Generator().manual_seed(11)
    ws = [(torch.randn(512, 1024, generator=gen) / 32).to(DEVICE, BF16) for _ in range(4)]
    path = tmp_path / "shared.json"
    monkeypatch.setattr(linear, "_TUNE_CACHE", linear.TuneCache(path))
    choice, times = linear.tune(ws, 32, "norm")
    assert linear.tune_cache().misses == 1 and path.exists()

    def no_timing(*a, **k):
        raise AssertionError("timed again")

    monkeypatch.setattr(linear, "graph_time", no_timing)
    monkeypatch.setattr(linear, "_TUNE_CACHE", linear.TuneCache(path))
    assert linear.tune(ws, 32, "norm") == (choice, times)
    assert linear.tune_cache().hits == 1
    x, res = (torch.randn(32, 1024, generator=gen).to(DEVICE, BF16) for _ in range(2))
    nw = (torch.randn(1024, generator=gen) * 0.1).to(DEVICE, BF16)
    close(linear.normed_linear(x, res.clone(), nw, 1e-6, ws[0], choice)[0],
          linear.normed_linear(x, res.clone(), nw, 1e-6, ws[0], None)[0])  # fmt: skip
    with pytest.raises(AssertionError, match="timed again"):  # other rows: not in the cache
        linear.tune(ws, 16, "norm")


@pytest.mark.skipif(DEVICE != "cuda", reason="times CUDA graphs")
@pytest.mark.parametrize("rows", [1, 4, 32, 128])
def test_tune_returns_a_setting_that_runs_and_is_right(rows):
    """kernels.linear.tune times cuBLAS and each candidate; whatever it picks gives F.linear's result, and a setting
    that cannot run (too much shared memory) is reported instead of raising."""
    from kernels import linear

    gen = torch.Generator().manual_seed(rows)
    ws = [(torch.randn(512, 1024, generator=gen) / 32).to(DEVICE, BF16) for _ in range(4)]
    choice, times = linear.tune(ws, rows)
    assert isinstance(times["cublas"], float) and len(times) > 1
    x = torch.randn(rows, 1024, generator=gen).to(DEVICE, BF16)
    close(linear.linear(x, ws[0], choice), torch.nn.functional.linear(x, ws[0]))
    assert linear.tune([w.float() for w in ws], rows) == (None, {})  # float32 stays on cuBLAS (no TF32)


@pytest.mark.skipif(DEVICE != "cuda", reason="times CUDA graphs")
def test_tune_drops_a_fast_setting_that_gives_a_wrong_result(monkeypatch):
    """A skinny setting that runs but computes something else (a kernel path never run on this GPU) is not
    picked: tune checks its pick against cuBLAS's result and falls back to cuBLAS, saying why."""
    from kernels import linear

    gen = torch.Generator().manual_seed(5)
    ws = [(torch.randn(512, 1024, generator=gen) / 32).to(DEVICE, BF16) for _ in range(4)]
    skinny = linear._skinny
    monkeypatch.setattr(linear, "_skinny", lambda x, w, s, conv=None, **f: skinny(x, w, s, conv, **f).mul_(1.5))
    calls = []  # cuBLAS is timed first: every skinny setting "runs" twice as fast

    def timed(fn, reps=20):
        calls.append(fn)
        return 1.0 if len(calls) == 1 else 0.5

    monkeypatch.setattr(linear, "graph_time", timed)
    choice, times = linear.tune(ws, 4)
    assert choice is None
    assert any(isinstance(t, str) and t.startswith("wrong result") for t in times.values()), times


@pytest.mark.skipif(DEVICE != "cuda", reason="16-bit weights (tune leaves float32 to cuBLAS)")
@pytest.mark.parametrize("rows,skinny,picked", [(128, 0.98, False), (128, 0.95, True), (32, 0.99, True)])
def test_tune_keeps_cublas_unless_beaten_by_its_margin_above_64_rows(monkeypatch, rows, skinny, picked):
    """Above CUBLAS_MARGIN_ROWS rows a skinny_linear setting must be CUBLAS_MARGIN faster than cuBLAS to be picked;
    at fewer rows any faster setting is."""
    from kernels import linear

    gen = torch.Generator().manual_seed(rows)
    ws = [(torch.randn(256, 512, generator=gen) / 32).to(DEVICE, BF16) for _ in range(4)]
    calls = []  # cuBLAS is timed first, every skinny setting after it alike

    def timed(fn, reps=20):
        calls.append(fn)
        return 1.0 if len(calls) == 1 else skinny

    monkeypatch.setattr(linear, "graph_time", timed)
    choice, times = linear.tune(ws, rows)
    assert (choice is not None) == picked, (choice, times)
    assert times["cublas"] == 1.0 / len(ws)  # seconds per weight
