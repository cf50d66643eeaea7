"""Speculative decoding served end to end, through pauses and recoveries: with the MTP head of a hybrid model (16-bit
and FP8 weights) and with draft-free prompt lookup on a dense model, every stream equals the offline engine's
non-speculative answer token for token (greedy and seeded), drafts are verified, and nothing is held afterwards.
Kept drafts on a hybrid model (the state carried past the draft) are tested in tests/hybrid/test_speculative.py with
drafts that are right by construction: random hybrid weights never repeat themselves, so no drafter guesses them."""

from __future__ import annotations

import pytest
import torch

from backends.common.core.request import SamplingParams
from backends.common.engine.engine import Engine
from tests.hybrid.conftest import qwen3_5_saved  # noqa: F401 (a fixture)
from tests.server.client import grpc_generate_all
from tests.server.conftest import Server

pytestmark = [pytest.mark.server, pytest.mark.slow]

N_OUT = 150
SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 7}


def params(i: int) -> dict:
    base = {"max_tokens": N_OUT, "ignore_eos": True}
    return {**base, **SEEDED} if i == 3 else {**base, "temperature": 0}


def prompts() -> list[list[int]]:
    return [[(37 * i + 11 * j) % 250 + 3 for j in range(40 + 7 * i)] for i in range(4)]


def run_streams(server) -> list:
    return grpc_generate_all(server.grpc_url, prompts(), [params(i) for i in range(4)])


@pytest.mark.parametrize(
    "model,mode,extra",
    [
        # random weights: the MTP head's drafts are all wrong, so every step rolls K/V and state back
        # with FP8 projections (MTP head included), paused and recovered from host memory (K/V and state)
        ("random:tiny-hybrid-fp8", "mtp", ["--fault-injection", "stale"]),
        ("random:tiny-hybrid", "mtp", ["--rotation-quantum", "0", "--fault-injection", "stale,drop_paused_kv"]),
        # the tiny dense model's greedy answers fall into loops, which prompt lookup drafts right
        ("random:tiny-test", "ngram", ["--host-kv-tokens", "0"]),
    ],
)
def test_speculative_streams_through_pauses_equal_plain_decoding(model, mode, extra):
    eng = Engine(model, dtype="float32", device="cpu", kv_tokens=4096)
    want = [o.output_ids for o in eng.generate(prompts(), [SamplingParams(**params(i)) for i in range(4)])]
    s = Server("--model", model, "--kv-tokens", "300", "--speculative", mode, *extra, name=f"spec-{mode}")
    try:
        results = run_streams(s)
        for i, (res, exp) in enumerate(zip(results, want)):
            assert res.error is None, res.error
            assert res.finish_reason == "length" and res.ids == exp, f"stream {i} differs from plain decoding"
        drafts = s.metric("pd_decode_spec_draft_tokens_total")
        accepted = s.metric("pd_decode_spec_accepted_tokens_total")
        print(f"{model} {mode}: {accepted:.0f} of {drafts:.0f} drafts kept ({accepted / max(drafts, 1):.1%})")
        assert drafts >= 20 and s.metric("pd_pauses_total") > 0
        if model == "random:tiny-test":
            assert accepted > drafts / 4
        if "stale,drop_paused_kv" in extra:  # recoveries through prefill, K/V and state under a new epoch
            assert s.metric("pd_recoveries_total", path="prefill") > 0
        s.assert_released(timeout=10)
        if "hybrid" in model:
            assert s.wait_metric("pd_state_pages_used", lambda v: v == 0) == 0
    finally:
        s.stop()


def test_qwen3_5_checkpoint_with_an_mtp_head_streams_through_pauses_equal_plain_decoding(qwen3_5_saved, tmp_path):  # noqa: F811
    """A Qwen3.5 checkpoint in the multimodal layout with an MTP head (`mtp.*`, the names Qwen3.5 checkpoints use;
    random here: transformers saves none), served with `--speculative mtp` on a pool that pauses: every stream
    equals the offline engine's plain answer, and nothing is held afterwards."""
    import dataclasses
    import shutil

    from safetensors.torch import save_file

    from backends.common.model import loader

    folder, _ = qwen3_5_saved
    for f in ("config.json", "model.safetensors"):
        shutil.copy(folder / f, tmp_path / f)
    cfg = dataclasses.replace(loader.load_config(loader.resolve(str(folder))), mtp_layers=1)
    mtp = {k: v.contiguous() for k, v in loader.random_hybrid_weights(cfg, torch.float32, "cpu").items()}
    save_file({k: v for k, v in mtp.items() if k.startswith("mtp.")}, str(tmp_path / "mtp.safetensors"))
    eng = Engine(str(tmp_path), dtype="float32", device="cpu", kv_tokens=4096)
    assert eng.runner.has_mtp
    want = [o.output_ids for o in eng.generate(prompts(), [SamplingParams(**params(i)) for i in range(4)])]
    s = Server("--model", str(tmp_path), "--kv-tokens", "300", "--speculative", "mtp", name="spec-qwen3.5")
    try:
        for i, (res, exp) in enumerate(zip(run_streams(s), want)):
            assert res.error is None, res.error
            assert res.finish_reason == "length" and res.ids == exp, f"stream {i} differs from plain decoding"
        assert s.metric("pd_decode_spec_draft_tokens_total") >= 20 and s.metric("pd_pauses_total") > 0
        s.assert_released(timeout=10)
        assert s.wait_metric("pd_state_pages_used", lambda v: v == 0) == 0
    finally:
        s.stop()
