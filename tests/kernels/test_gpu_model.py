"""The GPU forward pass (backends.common.model.gpu_model: Triton kernels, slot table, CUDA graphs) against the plain
PyTorch model on the same weights and KV pool layout. GPU only (see test_kernels.py for the interpreter switch)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
DEVICE = os.environ.get("TRITON_PD_KERNEL_DEVICE", "cuda")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from backends.common.core.config import ModelConfig  # noqa: E402
from backends.common.model import loader  # noqa: E402
from backends.common.model.batch import Span, build_batch  # noqa: E402
from backends.common.model.gpu_model import GpuLlama  # noqa: E402
from backends.common.model.kv_store import KVStore  # noqa: E402
from backends.common.model.model import LlamaModel  # noqa: E402

pytestmark = pytest.mark.gpu
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def tiny(**kw) -> ModelConfig:
    base = dict(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=32, max_position_embeddings=512, rope_theta=10000.0,
    )  # fmt: skip
    base.update(kw)
    return ModelConfig(**base)


def pair(cfg, slots=600, graphs=None, linear_choice=None):
    w = loader.random_weights(cfg, DTYPE, DEVICE, seed=1)
    ref = LlamaModel(cfg, dict(w))
    kv_ref = KVStore.allocate(cfg.num_layers, slots + 1, cfg.num_kv_heads, cfg.head_dim, DTYPE, DEVICE)
    kv_gpu = KVStore.allocate(cfg.num_layers, slots + 1, cfg.num_kv_heads, cfg.head_dim, DTYPE, DEVICE)
    gpu = GpuLlama(
        cfg, dict(w), kv_gpu, scratch_slot=slots, max_batch=8, graph_sizes=graphs, linear_choice=linear_choice
    )
    return ref, kv_ref, gpu, kv_gpu


class RefRunner:
    """The reference path on a given model and pool, without loading anything."""

    def __init__(self, model, kv):
        self.model, self.kv, self.device = model, kv, torch.device(DEVICE)

    def forward(self, spans):
        return self.model.forward(build_batch(spans, self.device), self.kv)


def run_both(ref_runner, gpu, spans):
    return ref_runner.forward(spans), gpu.forward(spans)


def close(a, b):
    tol = 5e-2 if DTYPE == torch.bfloat16 else 1e-3
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "cfg",
    [tiny(head_dim=64, num_heads=4), tiny(attention_bias=True), tiny(qk_norm=True, tie_word_embeddings=True)],
    ids=["llama", "qkv-bias", "qk-norm-tied"],
)
def test_mixed_batches_match_reference(cfg):
    """A prefill, then a chunk on a cached prefix mixed with decode tokens, then decode only: same logits, and the
    slot table follows slot lists that grow between steps."""
    ref, kv_ref, gpu, _ = pair(cfg)
    r = RefRunner(ref, kv_ref)
    gen = torch.Generator().manual_seed(0)
    a_ids = torch.randint(0, cfg.vocab_size, (70,), generator=gen).tolist()
    b_ids = torch.randint(0, cfg.vocab_size, (40,), generator=gen).tolist()
    a_slots = list(range(100, 170))
    b_slots = list(range(300, 340))
    step1 = [Span(a_ids[:50], 0, a_slots[:50], "a"), Span(b_ids[:1], 0, b_slots[:1], "b")]
    close(*run_both(r, gpu, step1))
    step2 = [Span(a_ids[50:70], 50, a_slots, "a"), Span(b_ids[1:2], 1, b_slots[:2], "b")]
    close(*run_both(r, gpu, step2))
    for t in range(2, 12):
        a_slots.append(400 + t)
        step = [Span([a_ids[t % 70]], 68 + t, a_slots, "a"), Span([b_ids[t]], t, b_slots[: t + 1], "b")]
        close(*run_both(r, gpu, step))


def skinny_everywhere(sizes=(1, 2, 4, 8)):
    """Every projection of every small graph on skinny_linear (settings that fit the tiny shapes)."""
    one = dict(block_n=32, block_k=64, num_warps=4, num_stages=2, dot=False)
    more = dict(one, dot=True)
    return {(n, bs): one if bs == 1 else more for n in ("qkv", "o", "gate_up", "down") for bs in sizes}


def split_and_gated(sizes=(1, 2, 4, 8), defer: bool = False):
    """skinny_everywhere with K cut in two parts, and silu(gate) * up fused into the down projection's launch.
    defer: o's and down's partial sums left to the add + RMSNorm launch after them (kernels.linear.Partials)."""
    choice = {k: dict(v, splits=2) for k, v in skinny_everywhere(sizes).items()}
    choice = {(n, bs): dict(v, gated=True) if n == "down" else v for (n, bs), v in choice.items()}
    return {(n, bs): dict(v, defer=True) if defer and n in ("o", "down") else v for (n, bs), v in choice.items()}


@pytest.mark.parametrize(
    "cfg,linear_choice",
    [
        (tiny(head_dim=64), None),
        (tiny(head_dim=64), skinny_everywhere()),
        (tiny(head_dim=64), split_and_gated()),
        (tiny(head_dim=64), split_and_gated(defer=True)),
        (tiny(qk_norm=True, tie_word_embeddings=True), skinny_everywhere()),
        (tiny(attention_bias=True), None),
    ],
    ids=["llama", "llama-skinny", "llama-split-gated", "llama-split-deferred", "qk-norm-tied-skinny", "qkv-bias"],
)
def test_decode_graphs_match_reference(cfg, linear_choice):
    """Graph replay, padded up to a captured size, gives the reference logits for batch sizes 1 to 7 (off CUDA the
    same replay path runs eagerly): the fused rotary embedding + KV store in the attention kernel, q/k norms,
    a q|k|v bias, and the projections on skinny_linear where the choice says so (K split, silu fused into down,
    o's and down's partial sums added by the add + RMSNorm launch after them)."""
    ref, kv_ref, gpu, _ = pair(cfg, slots=1500, graphs=(1, 2, 4, 8), linear_choice=linear_choice)
    assert gpu.linear_choice == (linear_choice or gpu.linear_choice)
    assert gpu.graph_sizes == [1, 2, 4, 8]
    r = RefRunner(ref, kv_ref)
    gen = torch.Generator().manual_seed(1)
    seqs = []
    for i in range(7):
        ids = torch.randint(0, cfg.vocab_size, (30 + 13 * i,), generator=gen).tolist()
        seqs.append({"key": f"s{i}", "ids": ids, "slots": list(range(i * 200, i * 200 + len(ids))), "n": 20 + 13 * i})
    close(*run_both(r, gpu, [Span(s["ids"][: s["n"]], 0, s["slots"][: s["n"]], s["key"]) for s in seqs]))
    for i, bsz in enumerate((1, 3, 7, 5, 2, 7, 4)):
        spans = []
        for s in seqs[:bsz]:
            n = s["n"]
            spans.append(Span([s["ids"][n]], n, s["slots"], s["key"]))  # one list object: incremental rows
            s["n"] += 1
        if i % 2:
            close(*run_both(r, gpu, spans))
        else:  # the graph's own argmax, copied back inside the graph, against its logits and the reference's
            tokens = gpu.greedy(spans)
            logits = gpu.graph_logits[:bsz]
            assert tokens == logits.argmax(-1).tolist()
            close(r.forward(spans), logits)


def test_launch_greedy_feeds_unread_tokens():
    """Step n+1 launched before step n's tokens are read, with id -1 for a sequence whose last token is unread: the
    graph takes the token step n left on the device. Every collected token is the reference's argmax when fed the
    collected tokens, and each step's logits match; the batch changes between steps (graph rows move)."""
    cfg = tiny(head_dim=64)
    ref, kv_ref, gpu, _ = pair(cfg, slots=1500, graphs=(1, 2, 4, 8))
    r = RefRunner(ref, kv_ref)
    gen = torch.Generator().manual_seed(2)
    seqs = []
    for i in range(5):
        ids = torch.randint(0, cfg.vocab_size, (20 + 7 * i,), generator=gen).tolist()
        seqs.append({"key": f"u{i}", "ids": ids, "slots": list(range(i * 200, i * 200 + len(ids))), "pos": len(ids)})
    logits = r.forward([Span(s["ids"], 0, s["slots"], s["key"]) for s in seqs])
    close(logits, gpu.forward([Span(s["ids"], 0, list(s["slots"]), s["key"]) for s in seqs]))
    for s, t in zip(seqs, logits.argmax(-1).tolist()):
        s["ids"].append(t)
    launched = []  # (handle, sequences, their input positions, the graph's logits)
    for step, bsz in enumerate((5, 5, 3, 3, 4, 4)):
        spans = []
        for s in seqs[:bsz]:
            p = s["pos"]
            s["slots"].append(1000 + 100 * int(s["key"][1:]) + step)
            spans.append(Span([s["ids"][p] if p < len(s["ids"]) else -1], p, s["slots"], s["key"]))
            s["pos"] = p + 1
        assert step == 0 or any(sp.token_ids == [-1] for sp in spans)
        handle = gpu.launch_greedy(spans)
        launched.append((handle, seqs[:bsz], [sp.start for sp in spans]))
        if len(launched) > 1:  # only now read the step before
            h, ss, _ = launched[-2]
            for s, t in zip(ss, gpu.collect(h)):
                s["ids"].append(t)
    h, ss, _ = launched[-1]
    for s, t in zip(ss, gpu.collect(h)):
        s["ids"].append(t)
    last = gpu.graph_logits[: len(ss)].clone()
    for _, ss, pos in launched:  # the reference, fed the collected tokens, one step at a time
        logits = r.forward([Span([s["ids"][p]], p, s["slots"][: p + 1], s["key"]) for s, p in zip(ss, pos)])
        for row, s, p in zip(logits, ss, pos):
            assert row[s["ids"][p + 1]] >= row.max() - 1e-3
    close(logits, last)


@pytest.mark.skipif(DEVICE != "cuda", reason="the engine's GPU path needs a GPU")
def test_engine_overlap_equals_synchronous():
    """The engine with steps launched over unread tokens (the default) gives the same tokens and finish reasons as
    without, with a stop id hit mid-batch; most decode steps overlap."""
    from backends.common.core.request import SamplingParams
    from backends.common.engine.engine import Engine
    from tests.common.test_engine import assert_idle

    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in (5, 40, 77, 130, 9, 64)]
    outs = []
    for overlap in (False, True):
        eng = Engine("random:smollm2-135m", "float32", "cuda", kv_tokens=4096, max_batch=8, chunk_size=32,
                     max_batch_tokens=64, overlap=overlap)  # fmt: skip
        if not outs:
            probe = eng.generate([prompts[2]], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
            stop = probe[0].output_ids[9]
        params = [SamplingParams(max_tokens=20 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(6)]
        params[2] = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
        eng.scheduler.radix.clear()
        outs.append([(o.output_ids, o.finish_reason) for o in eng.generate(prompts, params)])
        assert_idle(eng)
        if overlap:
            assert eng.num_overlapped > 20
        del eng
    assert outs[0] == outs[1]
    assert outs[1][2][1] == "stop" and len(outs[1][2][0]) <= 10


@pytest.mark.skipif(DEVICE != "cuda", reason="the engine's GPU path needs a GPU")
def test_engine_tokens_are_reference_argmax():
    """The offline engine on the GPU path (chunked prefill mixed with decode, graphs) in float32: every greedy token
    is the reference model's argmax at that position, up to float32 rounding near ties."""
    from backends.common.core.request import SamplingParams
    from backends.common.engine.engine import Engine

    spec = "random:smollm2-135m"
    eng = Engine(spec, "float32", "cuda", kv_tokens=4096, max_batch=8, chunk_size=32, max_batch_tokens=64)
    assert eng.runner.backend == "triton"
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in (5, 40, 77, 130, 9, 64)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    src = loader.resolve(spec)
    cfg = loader.load_config(src)
    ref = LlamaModel(cfg, loader.load_weights(src, torch.float32, "cuda"))
    kv = KVStore.allocate(cfg.num_layers, 512, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cuda")
    r = RefRunner(ref, kv)
    for p, o in zip(prompts, outs):
        assert len(o.output_ids) == 20
        seq = p + o.output_ids[:-1]
        # logits after every position of seq, one reference forward per position (small model, short sequences)
        for j in range(len(p) - 1, len(seq)):
            logits = r.forward([Span(seq[: j + 1], 0, list(range(j + 1)))])[0]
            tok = o.output_ids[j - len(p) + 1]
            assert logits[tok] >= logits.max() - 1e-3, (j, tok, int(logits.argmax()))


def test_graph_argmax_takes_the_first_maximum():
    """The decode graph's two-stage argmax (chunk maxima, then the best chunk) equals torch.argmax, ties included."""
    cfg = tiny()
    _, _, gpu, _ = pair(cfg, graphs=(1, 2, 4))
    V = cfg.vocab_size
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    logits[1, [7, V - 3]] = 50.0  # equal maxima in different chunks
    logits[2, [0, 1]] = 50.0  # equal maxima in one chunk
    logits[3, V - 1] = 50.0  # the last real column, next to the -inf padding
    with torch.inference_mode():
        gpu.graph_logits[:4] = logits
    assert gpu._argmax(4).tolist() == logits.argmax(-1).tolist() == [int(logits[0].argmax()), 7, 0, V - 1]
