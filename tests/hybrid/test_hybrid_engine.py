"""The hybrid (Qwen3-Next) path against transformers, and against itself under chunking, prefix hits and
preemption: the state restored with the K/V must be the state at the same position."""

from __future__ import annotations

import os

import pytest
import torch

from backends.common.core.request import SamplingParams
from tests.conftest import hf_greedy
from tests.hybrid.conftest import chunked_logits, make_engine, prompt

# whole-model runs through the kernels: seconds each on a GPU, tens of seconds in Triton's CPU interpreter, so
# `make test-fast` (-m "not slow") leaves them to `make test`
WHOLE_MODEL = pytest.mark.slow


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def assert_idle(engine):
    sch = engine.scheduler
    free, used, cached = sch.accounting()
    assert used == 0 and free + cached == sch.pool.num_slots and sch.radix.protected_size == 0
    sfree, live, ckpts = sch.state_accounting()
    assert live == 0 and sfree + ckpts == engine.state_pages.num_pages
    sch.radix.clear()
    assert sch.state_accounting() == (engine.state_pages.num_pages, 0, 0)
    assert sch.pool.num_free == sch.pool.num_slots


@pytest.fixture(scope="module")
def engine(hybrid_folder):
    return make_engine(hybrid_folder)


def test_config_reads_the_layer_mix(engine):
    cfg = engine.cfg
    assert cfg.is_hybrid and cfg.linear_layers == [0, 1, 2] and cfg.full_layers == [3]
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert engine.runner.kv.num_layers == 1  # K/V only for the full-attention layer


def test_prefill_logits_match_transformers_whole_and_in_uneven_chunks(engine, hybrid_hf):
    ids = prompt(1, 200)
    with torch.no_grad():
        ref = hybrid_hf(torch.tensor([ids])).logits[0].float()
    for cuts in ([0, 200], [0, 17, 81, 150, 200]):
        assert (chunked_logits(engine, ids, cuts) - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("n", [5, 150])
def test_greedy_equals_transformers(engine, hybrid_hf, n):
    ids = prompt(n, n)
    out = engine.generate([ids], greedy(32))[0]
    assert out.output_ids == hf_greedy(hybrid_hf, ids, 32)
    assert_idle(engine)


def test_prefix_hit_restores_state_at_a_checkpoint_and_equals_a_cold_run(engine, hybrid_hf):
    shared = prompt(7, 130)  # chunks of 64: checkpoints at 64 and 128
    first = engine.generate([shared + prompt(8, 9)], greedy(8))[0]
    before = engine.scheduler.num_cached_tokens
    second_ids = shared + prompt(9, 11)
    second = engine.generate([second_ids], greedy(16))[0]
    assert engine.scheduler.num_cached_tokens - before == 128  # the deepest checkpoint inside the shared part
    assert second.output_ids == hf_greedy(hybrid_hf, second_ids, 16)
    assert first.output_ids == hf_greedy(hybrid_hf, shared + prompt(8, 9), 8)
    assert_idle(engine)


def test_batched_ragged_mixed_prefill_and_decode_equal_alone(engine):
    prompts = [prompt(20 + i, n) for i, n in enumerate([3, 40, 97, 1, 64, 130])]
    alone = [engine.generate([p], greedy(12))[0].output_ids for p in prompts]
    engine.scheduler.radix.clear()
    together = engine.generate(prompts, greedy(12))
    assert [o.output_ids for o in together] == alone
    assert_idle(engine)


def test_preemption_under_a_tiny_pool_keeps_every_token(hybrid_folder):
    prompts = [prompt(40 + i, 50 + 7 * i) for i in range(6)]
    params = [greedy(40), SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)]
    ref_engine = make_engine(hybrid_folder)
    small = make_engine(hybrid_folder, kv_tokens=300, state_pages=20)
    for p in params:
        ref = [o.output_ids for o in ref_engine.generate(prompts, p)]
        got = [o.output_ids for o in small.generate(prompts, p)]
        assert got == ref
    assert small.scheduler.num_preemptions > 0
    assert_idle(small)


def test_state_pages_run_short_drop_checkpoints_not_requests(hybrid_folder):
    """With pages for the running requests only, checkpoints are dropped (least recently used) and every answer is
    still exact."""
    eng = make_engine(hybrid_folder, max_batch=4, state_pages=5)
    prompts = [prompt(60 + i, 140) for i in range(8)]
    ref = [o.output_ids for o in make_engine(hybrid_folder).generate(prompts, greedy(10))]
    assert [o.output_ids for o in eng.generate(prompts, greedy(10))] == ref
    assert_idle(eng)


def test_random_hybrid_shape_generates():
    from backends.common.engine.engine import Engine

    eng = Engine("random:tiny-hybrid", dtype="float32", device="cpu", kv_tokens=1024)
    out = eng.generate([[5, 6, 7, 8]], greedy(6))[0]
    assert len(out.output_ids) == 6 and eng.cfg.is_hybrid


@WHOLE_MODEL
def test_delta_rule_kernels_in_the_engine_give_the_same_tokens(hybrid_folder, engine):
    """The engine with the Triton kernels (the interpreter on a CPU; MoE layers included) against the PyTorch
    reference: ragged prefill spans in one varlen launch, batched decode steps writing the pages in place, then the
    same prompts again in the other order, where prefix hits restore the checkpoints of a shared prefix."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    shared = prompt(79, 66)  # past the first chunk of 64: a checkpoint to hit
    prompts = [shared + prompt(80 + i, 1 + 12 * i) for i in range(2)]  # every token a few seconds interpreted
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref = engine if device == "cpu" else make_engine(hybrid_folder, device=device, backend="torch")
    fast = make_engine(hybrid_folder, device=device, backend="triton")
    fast_model = fast.runner.model  # the graph step (GpuHybrid) over an eager model with the kernels
    assert getattr(fast_model, "eager", fast_model).kd is not None and ref.runner.model.kd is None
    for batch in (prompts, prompts[::-1]):  # a prefill and 2 decode steps: each takes seconds interpreted
        want = [o.output_ids for o in ref.generate(batch, greedy(3))]
        assert [o.output_ids for o in fast.generate(batch, greedy(3))] == want
    assert fast.scheduler.num_cached_tokens > 0
    assert_idle(fast)
    assert_idle(ref)


def test_a_saved_folder_with_an_mtp_head_loads_as_the_same_model(tmp_path):
    """random:tiny-hybrid written as a Hugging Face folder (config.json from ModelConfig.to_hf, safetensors with
    the checkpoint's names, mtp.* included) loads back with its MTP head and gives the same tokens."""
    import json

    from safetensors.torch import save_file

    from backends.common.core.config import SHAPES, ModelConfig
    from backends.common.model import loader

    cfg = SHAPES["tiny-hybrid"]
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    weights = loader.random_hybrid_weights(cfg, torch.float32, "cpu")
    assert any(k.startswith("mtp.") for k in weights)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    ids = prompt(90, 33)
    a = make_engine(tmp_path)
    b = make_engine("random:tiny-hybrid")
    assert a.runner.has_mtp and b.runner.has_mtp and a.runner.kv.num_layers == 2  # one full layer + the MTP head's
    assert a.generate([ids], greedy(8))[0].output_ids == b.generate([ids], greedy(8))[0].output_ids
