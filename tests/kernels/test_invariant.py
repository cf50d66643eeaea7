"""Batch invariance of kernels.invariant (`--deterministic`, issue #29): a row's bits do not depend on the other rows
of its batch, on the tiles a launch uses, on prefill chunking, or on decode against prefill; and the dense GPU
model in that mode gives a sequence the same logits alone and among random companions, eager and graphed, and
writes the same K/V for a position whether a prefill (in any chunks) or a decode step computed it.

On a CUDA GPU in bfloat16; on the CPU through Triton's interpreter in float32 (smaller shapes), where the same
equalities are asserted bit for bit as well, with an order-fixed tl.dot (the `ordered_dot` fixture)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it without a GPU
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from kernels import invariant, reference  # noqa: E402

# bit-for-bit checks of interpreted kernels: a tl.dot whose rounding is the CPU's and BLAS build's own would make
# them pass on some hosts only (tests/interpreter_dot.py)
pytestmark = pytest.mark.usefixtures("ordered_dot")

GPU = DEVICE == "cuda"
DTYPE = torch.bfloat16 if GPU else torch.float32
TOL = dict(atol=3e-2, rtol=3e-2) if GPU else dict(atol=1e-4, rtol=1e-4)


def rand(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, DTYPE)


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bitwise equal (NaN-free inputs): the first differing element named on failure."""
    diff = (a != b).reshape(a.shape[0], -1).any(-1).nonzero()
    assert diff.numel() == 0, f"{what}: rows {diff.flatten()[:8].tolist()} differ"


@pytest.mark.parametrize("K", [96, 200] if not GPU else [576, 4096, 14336])
def test_linear_rows_do_not_depend_on_the_batch(K):
    gen = torch.Generator().manual_seed(K)
    N = 200 if not GPU else 1000
    rows = 40 if not GPU else 300
    x = rand(rows, K, gen=gen)
    w = rand(N, K, gen=gen, scale=K**-0.5)
    bias = rand(N, gen=gen)
    full = invariant.linear(x, w)
    torch.testing.assert_close(full.float(), F.linear(x.float(), w.float()), **TOL)
    for m in (1, 2, 5, 16, 17, 33, 65, 257, rows) if GPU else (1, 2, 5, 33, rows):
        same(invariant.linear(x[:m], w), full[:m], f"first {m} rows")
    # one row among random companions, in every tile setting (bitwise on the GPU; numpy's matmul, which the
    # interpreter's dot uses, rounds differently for different tile shapes)
    for i in (0, 7, rows - 1):
        batch = torch.cat((x[i : i + 1], rand(12, K, gen=gen)))
        for st in invariant.TILES:
            got = invariant.linear(batch, w, settings=st)[:1]
            if GPU:
                same(got, full[i : i + 1], f"row {i} {st}")
            else:
                torch.testing.assert_close(got, full[i : i + 1], **TOL)
    with_bias = invariant.linear(x, w, bias)
    torch.testing.assert_close(with_bias.float(), F.linear(x.float(), w.float(), bias.float()), **TOL)
    same(invariant.linear(x[:3], w, bias), with_bias[:3], "bias, 3 rows")


def pool_and_table(L, hkv, d, gen, companions=()):
    """A KV pool with one sequence of L positions in table row 1 and the companions' rows after it."""
    lens = [L, *companions]
    slots = sum(lens) + 8
    k, v = rand(slots, hkv, d, gen=gen), rand(slots, hkv, d, gen=gen)
    table = torch.zeros(len(lens) + 1, max(lens) + 64, dtype=torch.int32)
    perm = torch.randperm(slots, generator=gen)
    used = 0
    for i, n in enumerate(lens):
        table[i + 1, :n] = perm[used : used + n].int()
        used += n
    return k, v, table.to(DEVICE)


def i32(xs):
    return torch.tensor(xs, dtype=torch.int32, device=DEVICE)


@pytest.mark.slow  # `make test` only: too long for `make test-fast`
@pytest.mark.parametrize("hkv,group,d", [(2, 4, 64)] if not GPU else [(8, 4, 128), (2, 8, 256), (4, 1, 64)])
def test_attention_decode_equals_prefill_in_any_chunks(hkv, group, d):
    """Position p's output: the whole-prompt prefill's row p = the row p of chunked prefills = the decode step at
    seq_len p + 1, alone or among companions, with any number of programs."""
    gen = torch.Generator().manual_seed(d + group)
    L = 300 if not GPU else 700
    H = hkv * group
    scale = d**-0.5
    k, v, table = pool_and_table(L, hkv, d, gen, companions=(40, 513, 7))
    q = rand(L, H, d, gen=gen)
    whole = invariant.prefill_attention(q, k, v, table, i32([1]), i32([0]), i32([L]), i32([L]), L, scale)
    ref = reference.prefill_attention(q, k, v, table, i32([1]), i32([0]), i32([L]), i32([L]), scale)
    torch.testing.assert_close(whole.float(), ref.float(), **TOL)
    for chunks in ([100, 150, L - 250], [1, 63, 64, L - 128], [L - 1, 1]):
        out, start = torch.empty_like(q), 0
        for n in chunks:
            invariant.prefill_attention(q, k, v, table, i32([1]), i32([start]), i32([n]), i32([start + n]), n, scale,
                                        out=out)  # fmt: skip
            start += n
        same(out, whole, f"chunks {chunks}")
    max_ctx = table.shape[1]
    for p in (0, 1, 255, 256, 257, L - 1):
        alone = invariant.decode_attention(q[p : p + 1], k, v, table, i32([1]), i32([p + 1]), scale, max_ctx)
        same(alone[0], whole[p], f"decode at {p}")
        # among companions (rows 2..4 of the table) with random queries, sequence in the middle, more programs
        qs = torch.cat((rand(2, H, d, gen=gen), q[p : p + 1], rand(1, H, d, gen=gen)))
        for programs in (1, 3):  # 1: segments merged in registers; 3: partials merged by the last program
            mixed = invariant.decode_attention(
                qs, k, v, table, i32([2, 3, 1, 4]), i32([40, 513, p + 1, 7]), scale, max_ctx, programs=programs
            )
            same(mixed[2], whole[p], f"decode at {p} among companions, {programs} programs")


@pytest.mark.slow  # a whole model in Triton's CPU interpreter: `make test` runs it, `make test-fast` leaves it
def test_gpu_model_deterministic_logits_and_kv():
    """GpuLlama(deterministic=True): a sequence's logits alone = among random companions in batches up to the
    largest graph (256 on the GPU), graphed and eager; the K/V decode wrote for generated positions = the K/V a
    prefill of prompt + generated tokens writes, in chunks of any size."""
    from backends.common.core.config import ModelConfig
    from backends.common.model import loader
    from backends.common.model.batch import Span
    from backends.common.model.gpu_model import GpuLlama
    from backends.common.model.kv_store import KVStore

    cfg = ModelConfig(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=64, max_position_embeddings=1024, rope_theta=10000.0,
    )  # fmt: skip
    max_batch, sizes = (256, None) if GPU else (8, (1, 4, 8))
    counts = (1, 2, 15, 31, 100, 255, 7, 63, 200, 128, 3, 254) if GPU else (2, 7, 1, 5)
    slots = 100_000 if GPU else 3000
    w = loader.random_weights(cfg, DTYPE, DEVICE, seed=3)
    kv = KVStore.allocate(cfg.num_layers, slots + 1, cfg.num_kv_heads, cfg.head_dim, DTYPE, DEVICE)
    kw = {} if sizes is None else {"graph_sizes": sizes}
    model = GpuLlama(cfg, w, kv, scratch_slot=slots, max_batch=max_batch, deterministic=True, **kw)
    gen = torch.Generator().manual_seed(5)
    prompt, n_gen = (270 if GPU else 24), len(counts)
    ids = torch.randint(0, cfg.vocab_size, (prompt + n_gen,), generator=gen).tolist()
    free = iter(range(slots))

    def take(n):
        return [next(free) for _ in range(n)]

    # prefill the prompt, then decode n_gen tokens alone (graph of 1), keeping each step's logits
    a_slots = take(prompt + n_gen)
    model.forward([Span(ids[:prompt], 0, a_slots, "a")])
    alone = []
    for t in range(n_gen):
        pos = prompt + t
        alone.append(model.forward([Span(ids[pos : pos + 1], pos, a_slots, "a")])[0].clone())  # graph logits: a view
    k_dec = [kv.k(i)[a_slots[prompt:]].clone() for i in range(cfg.num_layers)]
    v_dec = [kv.v(i)[a_slots[prompt:]].clone() for i in range(cfg.num_layers)]

    # the same sequence again in fresh slots, decoded among companions (graphs of every size, and eager mixed steps)
    b_slots = take(prompt + n_gen)
    model.forward([Span(ids[:prompt], 0, b_slots, "b")])
    others = []
    for j in range(max(counts)):
        o_ids = torch.randint(0, cfg.vocab_size, (20 + 37 * j % (300 if GPU else 9),), generator=gen).tolist()
        o_slots = take(len(o_ids) + n_gen)
        model.forward([Span(o_ids, 0, o_slots, f"o{j}")])
        others.append((o_ids, o_slots, [len(o_ids)]))
    for t, n in enumerate(counts):
        pos = prompt + t
        spans = []
        for j, (_o, sl, at) in enumerate(others[:n]):  # each companion continues where it stopped
            spans.append(Span([(7 * j + t) % cfg.vocab_size], at[0], sl, f"o{j}"))
            at[0] += 1
        spans.insert(t * 7 % (n + 1), me := Span(ids[pos : pos + 1], pos, b_slots, "b"))
        if t % 4 == 3:  # a prefill chunk in the same step: the eager path
            spans.append(Span(ids[:9], 0, take(9), f"x{t}"))
        out = model.forward(spans)
        same(out[spans.index(me)], alone[t], f"step {t} with {len(spans) - 1} companions")

    # recompute prompt + generated positions by prefill in chunks: the K/V of the generated positions equal decode's
    for chunk in (prompt + n_gen, 7, 64, 100) if GPU else (prompt + n_gen, 7):
        c_slots = take(prompt + n_gen)
        start = 0
        while start < prompt + n_gen:
            n = min(chunk, prompt + n_gen - start)
            model.forward([Span(ids[start : start + n], start, c_slots, f"c{chunk}")])
            start += n
        for i in range(cfg.num_layers):
            same(kv.k(i)[c_slots[prompt:]], k_dec[i], f"K layer {i}, chunks of {chunk}")
            same(kv.v(i)[c_slots[prompt:]], v_dec[i], f"V layer {i}, chunks of {chunk}")
