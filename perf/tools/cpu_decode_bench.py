"""CPU decode throughput of the offline engine beside Hugging Face transformers, same model, same machine, same run.

    python perf/engine.py cpu [--batches 1 16] [--new-tokens 64] [--prompt-tokens 32]

Both sides generate the same number of tokens greedily with EOS ignored from the same prompts; tokens/s counts
generated tokens over the whole generate call (prefill included, the same for both).
"""

from __future__ import annotations

import argparse
import time

import torch


def bench_ours(engine, prompts, n):
    from backends.common.core.request import SamplingParams

    engine.scheduler.radix.clear()
    t = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    dt = time.perf_counter() - t
    assert all(len(o.output_ids) == n for o in outs)
    return len(prompts) * n / dt


def bench_hf(model, prompts, n):
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    dt = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + n
    return len(prompts) * n / dt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from backends.common.engine.engine import Engine
    from backends.common.model import loader

    engine = Engine("smollm2", dtype="float32", device="cpu", kv_tokens=16384)
    hf = AutoModelForCausalLM.from_pretrained(str(loader.resolve("smollm2").folder), dtype=torch.float32).eval()
    base = engine.tokenizer.encode(
        "The history of science is the study of the development of science and "
        "scientific knowledge, including both the natural and social sciences. " * 4
    )
    print(
        f"CPU threads: {torch.get_num_threads()}, SmolLM2-135M fp32, prompt {a.prompt_tokens} tokens, "
        f"{a.new_tokens} new tokens, greedy"
    )
    print(f"{'batch':>5} {'ours tok/s':>11} {'HF tok/s':>9} {'ratio':>6}")
    for b in a.batches:
        prompts = [base[i : i + a.prompt_tokens] for i in range(b)]  # distinct prompts, no prefix sharing
        bench_ours(engine, prompts[:1], 4)  # warm-up
        ours = bench_ours(engine, prompts, a.new_tokens)
        hf_tps = bench_hf(hf, prompts, a.new_tokens)
        print(f"{b:>5} {ours:>11.1f} {hf_tps:>9.1f} {ours / hf_tps:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
