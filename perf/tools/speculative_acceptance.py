"""Speculative decoding served: acceptance rate, tokens per decode step and wall time against the same streams
without speculation, on the same server options in the same run; every answer checked against plain decoding.

    python perf/served.py speculative [--cases smollm2:ngram random:tiny-hybrid:mtp ...] [--out FILE.md]

Each case starts a server with `--speculative MODE` and one with `--speculative off`, sends the same concurrent
greedy streams to both, and reports drafts verified, drafts kept (the acceptance rate), decode steps per token and
the wall time. smollm2's prompts ask it to repeat and extend lists, where prompt lookup has something to find;
random weights give the MTP head nothing to predict, so its rate there only shows that it verifies and rolls back.
"""

from __future__ import annotations

import argparse
import sys
import time

from perf.tools.limits import report_writer, wall_clock_limit
from tests.server.client import grpc_generate_all
from tests.server.conftest import Server

SMOLLM2_PROMPTS = [
    "List the numbers from 1 to 40, separated by commas.",
    "Repeat the following sentence five times: The quick brown fox jumps over the lazy dog.",
    "Write the alphabet in capital letters, one letter per line.",
    "Write a Python function that returns the first n Fibonacci numbers, then call it for n = 1 to 5.",
]


def prompts_for(model: str, engine_tokenizer) -> list[list[int]]:
    if model == "smollm2":
        return [engine_tokenizer.encode_chat(p) for p in SMOLLM2_PROMPTS]
    return [[(37 * i + 11 * j) % 250 + 3 for j in range(40 + 7 * i)] for i in range(4)]


def run(server: Server, prompts, n_out: int) -> tuple[list, float]:
    t = time.perf_counter()
    params = [{"max_tokens": n_out, "temperature": 0}] * len(prompts)
    out = grpc_generate_all(server.grpc_url, prompts, params, timeout=600)
    return out, time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["smollm2:ngram", "random:tiny-test:ngram",
                                                   "random:tiny-hybrid:ngram", "random:tiny-hybrid:mtp"])  # fmt: skip
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--serve-args", default="", help="extra `triton-pd serve` options for every server")
    ap.add_argument("--time-limit", type=float, default=1500)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from backends.common.engine.engine import Engine

    lines = ["# Speculative decoding, served (greedy, concurrent streams)", "",
             "Command: `python perf/served.py speculative`"
             + (f" --serve-args '{a.serve_args}'" if a.serve_args else ""), "",
             "| model | drafter | drafts verified | kept | acceptance | decode steps per token | wall (spec) | "
             "wall (off) | answers equal off |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    servers: list[Server] = []

    write = report_writer(lines, a.out)

    timer = wall_clock_limit(a.time_limit, write, servers)
    failed = False
    for case in a.cases:
        model, mode = case.rsplit(":", 1)
        tok = Engine(model, device="cpu", kv_tokens=64).tokenizer
        prompts = prompts_for(model, tok)
        res = {}
        for m in (mode, "off"):
            s = Server("--model", model, "--speculative", m, *a.serve_args.split(), name=f"spec-{m}")
            servers.append(s)
            try:
                outs, wall = run(s, prompts, a.new_tokens)
                res[m] = dict(outs=outs, wall=wall, drafts=s.metric("pd_decode_spec_draft_tokens_total"),
                              kept=s.metric("pd_decode_spec_accepted_tokens_total"))  # fmt: skip
            finally:
                s.stop()
                servers.remove(s)
        sp, off = res[mode], res["off"]
        tokens = sum(len(r.ids) for r in sp["outs"] if r.error is None)
        same = all(x.error is None and x.ids == y.ids for x, y in zip(sp["outs"], off["outs"]))
        failed |= not same
        rate = sp["kept"] / max(sp["drafts"], 1)
        # each kept draft is a token that took no step of its own
        per_token = (tokens - len(prompts) - sp["kept"]) / max(tokens - len(prompts), 1)
        lines.append(
            f"| {model} | {mode} | {sp['drafts']:.0f} | {sp['kept']:.0f} | {rate:.1%} | {per_token:.2f} | "
            f"{sp['wall']:.1f} s | {off['wall']:.1f} s | {'yes' if same else 'NO'} |"
        )
        write()
    timer.cancel()
    lines += ["", f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {a.serve_args or 'the default options (CPU)'}."]
    write()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
