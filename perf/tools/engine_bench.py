"""Offline engine on the GPU against the HBM roofline and Hugging Face transformers, measured in one run.

    python perf/engine.py dense [--model random:llama3.1-8b] [--out perf/results/engine_bench_h200.md]
                                [--skip-hf] [--requests 256] [--hf-requests 64]

Prints and writes (markdown):
1. the HBM bandwidth measured here (a 2 GiB device-to-device copy, read + write bytes over time);
2. the decode step time at batch 1, 32 and 128 with context 1024: the captured CUDA graph alone, and a whole engine
   step (host inputs, graph with its argmax, reading the tokens back), each against its roofline
   (weight bytes read + KV bytes read) / bandwidth;
3. offline throughput for N requests with input and output lengths uniform in [100, 1024] (seed 0, ignore EOS,
   greedy), on the first 64 requests (with the engine's default overlap of decode steps, and without it) and on all
   of them, each run from an empty prefix cache;
4. transformers (continuous batching via `init_continuous_batching`, `paged|sdpa` attention) on the same first 64
   requests, and its decode step at the same batch sizes (one token over a 1024-token DynamicCache); the ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from perf.tools.timing import copy_bandwidth, cuda_time  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_report(text: str, res: dict, out: str | None, json_path: str | None) -> None:
    """The markdown report to `out` and the raw numbers to `json_path`, each when given."""
    if out:
        Path(out).write_text(text)
    if json_path:
        Path(json_path).write_text(json.dumps(res, indent=1))


def print_report(lines: list[str], res: dict, out: str | None, json_path: str | None) -> int:
    """A sweep's end: its report printed and written (`write_report`); main's exit status 0."""
    text = "\n".join(lines) + "\n"
    print(text)
    write_report(text, res, out, json_path)
    return 0


def workload(n: int, seed: int = 0, vocab: int = 32000) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    ins = torch.randint(100, 1025, (n,), generator=g).tolist()
    outs = torch.randint(100, 1025, (n,), generator=g).tolist()
    return [(torch.randint(0, vocab, (i,), generator=g).tolist(), o) for i, o in zip(ins, outs)]


def weight_bytes_read(cfg, dtype_size: int) -> int:
    """Every weight is read once per decode step except the embedding table (only B rows of it)."""
    h, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * f + 2 * h
    return dtype_size * (cfg.num_layers * per_layer + h + cfg.vocab_size * h)


def kv_bytes_read(cfg, batch: int, ctx: int, dtype_size: int) -> int:
    return dtype_size * batch * ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim


def engine_step(runner, spans) -> list[int]:
    """What the engine does for a greedy decode batch: the graph's own argmax when it can, else logits + argmax."""
    tokens = runner.greedy(spans)
    return tokens if tokens is not None else runner.forward(spans).argmax(-1).tolist()


def ours_decode_steps(engine, batches, ctx, bw):
    from backends.common.model.batch import Span

    runner = engine.runner
    cfg = runner.cfg
    rows = []
    for b in batches:
        spans = [Span([1], ctx, list(range(i * (ctx + 1), (i + 1) * (ctx + 1))), f"bench{b}-{i}") for i in range(b)]
        for _ in range(3):
            engine_step(runner, spans)
        reps = 50
        t_graph = cuda_time(runner.model.graphs[runner.model.graph_size(b)].replay, reps, warmup=3)
        t0 = time.perf_counter()
        for _ in range(reps):
            engine_step(runner, spans)
        t_step = (time.perf_counter() - t0) / reps
        nbytes = weight_bytes_read(cfg, 2) + kv_bytes_read(cfg, b, ctx + 1, 2)
        roof = nbytes / bw
        rows.append({"batch": b, "graph_ms": t_graph * 1e3, "step_ms": t_step * 1e3, "roofline_ms": roof * 1e3})
        ms = f"graph {t_graph * 1e3:.2f} ms, step {t_step * 1e3:.2f} ms, roofline {roof * 1e3:.2f} ms"
        log(f"ours decode b={b}: {ms}")
        for i in range(b):
            runner.forget(f"bench{b}-{i}")
    return rows


def ours_throughput(engine, reqs):
    from backends.common.core.request import SamplingParams

    # a cold cache, as transformers has: the subset's prompts are the first 64 of all 256, and a warm cache would
    # skip their prefill in the second run
    engine.scheduler.radix.clear()
    torch.cuda.synchronize()
    stats = engine.runner.model.stats
    t0 = time.perf_counter()
    steps0 = engine.num_steps
    added = [engine.add_request(p, SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True)) for p, o in reqs]
    spent = {"graph": 0.0, "eager": 0.0}
    while engine.has_work():
        g0, t = stats["graph_steps"], time.perf_counter()
        engine.step()  # the loop ends once the last step's tokens are read: all GPU work included
        spent["graph" if stats["graph_steps"] > g0 else "eager"] += time.perf_counter() - t
    dt = time.perf_counter() - t0
    n_out = sum(len(r.output_ids) for r in added)
    assert n_out == sum(o for _, o in reqs), "ignore_eos: every request must produce exactly max_tokens"
    return {"requests": len(reqs), "output_tokens": n_out, "seconds": dt, "tok_s": n_out / dt,
            "steps": engine.num_steps - steps0, "graph_s": spent["graph"], "eager_s": spent["eager"]}  # fmt: skip


def hf_model(cfg):
    from transformers import LlamaConfig, LlamaForCausalLM

    hc = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, rope_scaling=cfg.rope_scaling,
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(hc).to(torch.bfloat16)
    return model.eval()


def hf_throughput(model, reqs):
    from transformers import GenerationConfig

    gc_ = GenerationConfig(max_new_tokens=max(o for _, o in reqs), do_sample=False, eos_token_id=None, pad_token_id=0)
    model.set_attn_implementation("paged|sdpa")
    manager = model.init_continuous_batching(generation_config=gc_)
    manager.start()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, (p, o) in enumerate(reqs):
        manager.add_request(input_ids=p, request_id=f"r{i}", max_new_tokens=o)
    done, n_out = 0, 0
    while done < len(reqs):
        r = manager.get_result(timeout=600)
        if r is None:
            continue
        done += 1
        n_out += len(r.generated_tokens)
        if done % 16 == 0:
            log(f"transformers: {done}/{len(reqs)} requests, {n_out} tokens, {time.perf_counter() - t0:.0f} s")
    dt = time.perf_counter() - t0
    manager.stop()
    return {"requests": len(reqs), "output_tokens": n_out, "seconds": dt, "tok_s": n_out / dt}


@torch.inference_mode()
def hf_decode_steps(model, cfg, batches, ctx):
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    rows = []
    for b in batches:
        try:
            cache = DynamicCache(config=model.config)
        except TypeError:
            cache = DynamicCache()
        for layer in range(cfg.num_layers):
            k = torch.randn(b, cfg.num_kv_heads, ctx, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
            cache.update(k, k.clone(), layer)
        ids = torch.ones(b, 1, dtype=torch.long, device="cuda")
        times = []
        for step in range(6):
            pos = torch.full((b, 1), ctx + step, device="cuda", dtype=torch.long)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
            out.logits.argmax(-1).tolist()
            times.append(time.perf_counter() - t0)
        t = sorted(times[1:])[len(times[1:]) // 2]
        rows.append({"batch": b, "step_ms": t * 1e3})
        log(f"transformers decode b={b}: {t * 1e3:.2f} ms")
        del cache
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama3.1-8b")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--hf-requests", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--kv-tokens", type=int, default=540_000)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default=None, help="write the markdown report here")
    ap.add_argument("--json", default=None, help="write the raw numbers here")
    a = ap.parse_args(argv)

    from backends.common.engine.engine import Engine

    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "model": a.model}
    bw = copy_bandwidth()
    res["bandwidth_TBps"] = bw / 1e12
    log(f"HBM copy bandwidth {bw / 1e12:.2f} TB/s")
    t0 = time.perf_counter()
    engine = Engine(
        a.model, "bfloat16", "cuda", kv_tokens=a.kv_tokens, max_batch=a.requests, chunk_size=a.chunk_size,
        max_batch_tokens=a.max_batch_tokens,
    )  # fmt: skip
    cfg = engine.cfg
    log(f"engine ready in {time.perf_counter() - t0:.0f} s (backend {engine.runner.backend}, "
        f"graphs {engine.runner.model.graph_sizes})")  # fmt: skip

    def save():  # after every phase, so that a run cut short still leaves what it measured
        write_report(render(res, a), res, a.out, a.json)

    res["ours_decode"] = ours_decode_steps(engine, a.batches, a.context, bw)
    save()
    reqs = workload(a.requests, 0, min(cfg.vocab_size, 32000))
    sub = reqs[: a.hf_requests]
    ours_throughput(engine, workload(8, 1, 1000))  # warm-up: kernels for prefill shapes
    log("ours: throughput on the subset")
    res["ours_subset"] = ours_throughput(engine, sub)
    log(f"ours subset: {res['ours_subset']}")
    engine.overlap = False  # the same subset with each step's tokens read before the next step is scheduled
    res["ours_subset_sync"] = ours_throughput(engine, sub)
    engine.overlap = True
    log(f"ours subset, no overlap: {res['ours_subset_sync']}")
    res["ours_all"] = ours_throughput(engine, reqs)
    log(f"ours all: {res['ours_all']}")
    save()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    if not a.skip_hf:
        import transformers

        res["transformers"] = transformers.__version__
        model = hf_model(cfg)
        try:
            res["hf_decode"] = hf_decode_steps(model, cfg, a.batches, a.context)
            save()
        except Exception as e:  # report, do not hide
            res["hf_decode_error"] = repr(e)
            log(f"transformers decode failed: {e!r}")
        try:
            res["hf_subset"] = hf_throughput(model, sub)
            log(f"transformers subset: {res['hf_subset']}")
        except Exception as e:
            res["hf_subset_error"] = repr(e)
            log(f"transformers continuous batching failed: {e!r}")
    save()
    print(render(res, a))
    return 0


def render(res, a) -> str:
    L = [f"# Offline engine benchmark ({res['gpu']}, {res['model']}, bf16)", ""]
    L.append(f"Command: `python perf/engine.py dense {' '.join(sys.argv[1:])}`  ")
    L.append(f"torch {res['torch']}, transformers {res.get('transformers', '-')}. HBM copy bandwidth measured in "
             f"this run: **{res['bandwidth_TBps']:.2f} TB/s** (read + write).")  # fmt: skip
    L += ["", f"## Decode step, context {a.context}", ""]
    L.append("| batch | roofline ms | ours: graph ms (× roofline) | ours: engine step ms (× roofline) | "
             "transformers ms (× roofline) | transformers / ours step |")  # fmt: skip
    L.append("|---|---|---|---|---|---|")
    hf = {r["batch"]: r["step_ms"] for r in res.get("hf_decode", [])}
    for r in res["ours_decode"]:
        roof = r["roofline_ms"]
        h = hf.get(r["batch"])
        hcol = f"{h:.2f} ({h / roof:.2f}×)" if h else "-"
        ratio = f"{h / r['step_ms']:.1f}×" if h else "-"
        L.append(f"| {r['batch']} | {roof:.2f} | {r['graph_ms']:.2f} ({r['graph_ms'] / roof:.2f}×) | "
                 f"{r['step_ms']:.2f} ({r['step_ms'] / roof:.2f}×) | {hcol} | {ratio} |")  # fmt: skip
    L += ["", "## Offline throughput (input and output lengths uniform in [100, 1024], seed 0, ignore EOS)", ""]
    L.append("| engine | requests | output tokens | seconds | output tokens/s |")
    L.append("|---|---|---|---|---|")
    rows = (("ours", "ours_subset"), ("ours, no overlap", "ours_subset_sync"), ("transformers paged|sdpa", "hf_subset"),
            ("ours", "ours_all"))  # fmt: skip
    for name, key in rows:
        r = res.get(key)
        if r:
            L.append(f"| {name} | {r['requests']} | {r['output_tokens']} | {r['seconds']:.1f} | {r['tok_s']:.0f} |")
    for key in ("ours_subset", "ours_all"):
        r = res.get(key)
        if r and "graph_s" in r:
            L.append(f"\nOurs, {r['requests']} requests: {r['steps']} steps; {r['graph_s']:.1f} s in decode steps "
                     f"(CUDA graphs), {r['eager_s']:.1f} s in steps with prefill (eager).")  # fmt: skip
    if res.get("hf_subset"):
        L.append("")
        L.append(f"Ours / transformers on the same {res['hf_subset']['requests']} requests: "
                 f"**{res['ours_subset']['tok_s'] / res['hf_subset']['tok_s']:.1f}×**.")  # fmt: skip
    for k in ("hf_decode_error", "hf_subset_error"):
        if k in res:
            L.append(f"\n{k}: `{res[k]}`")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
