"""`triton-pd bench replay | compare | to-perf-analyzer`: trace replay benchmarks (the work is in replay.py)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from .server_process import ServerError, start_deployment


def _trace_args(p) -> None:
    p.add_argument("--trace", required=True, help="Mooncake .jsonl, Azure .csv, or synthetic:N,RATE")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (0.5 = twice the rate)")
    p.add_argument("--sample", type=float, default=1.0, help="keep this fraction of requests (seeded)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=float, default=0.0, help="seconds into the trace")
    p.add_argument("--duration", type=float, default=None, help="seconds of the trace to replay")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--input-scale", type=float, default=1.0, help="multiply prompt lengths (and prefix blocks)")
    p.add_argument("--output-scale", type=float, default=1.0, help="multiply output lengths")
    p.add_argument("--max-input", type=int, default=None, help="clip prompt lengths to this")
    p.add_argument("--max-output", type=int, default=None, help="clip output lengths to this")
    p.add_argument("--context", type=int, default=None, help="model context (default: from --model)")
    p.add_argument("--model", default="smollm2", help="the served model: its context and vocabulary")
    p.add_argument(
        "--conversations",
        type=int,
        default=0,
        help="traces without prefix information (Azure): spread requests over this many multi-turn conversations "
        "whose turns share prefixes (0: every prompt its own)",
    )


def _run_args(p) -> None:
    p.add_argument("--max-users", type=int, default=256, help="concurrent virtual users at most")
    p.add_argument("--timeout", type=float, default=1800, help="client-side limit per request (s)")
    p.add_argument(
        "--run-limit",
        type=float,
        default=None,
        help="wall-clock limit of one replay run (s): then open streams are cancelled and counted 'unfinished', "
        "and the report is written (default: the trace's span + --timeout)",
    )
    p.add_argument(
        "--stuck-after",
        type=float,
        default=120.0,
        help="a stream with no response for this long is cancelled and counted 'stuck' (s)",
    )
    p.add_argument("--out", required=True, help="folder for records, metrics, report and plots")
    p.add_argument("--no-plots", action="store_true")


def register(sub) -> None:
    b = sub.add_parser("bench", help="trace replay benchmarks").add_subparsers(dest="bench_cmd", required=True)
    r = b.add_parser("replay", help="replay a trace against a running server (gRPC streaming)")
    _trace_args(r)
    _run_args(r)
    r.add_argument("--url", default="127.0.0.1:8001", help="the server's gRPC address")
    r.add_argument("--metrics-url", default="127.0.0.1:8002", help="its metrics address ('' to skip sampling)")
    r.add_argument("--name", default="run", help="label of this run in the report")
    r.set_defaults(func=cmd_replay)
    c = b.add_parser("compare", help="start a server per --on-decode-oom mode, replay the same trace, compare")
    _trace_args(c)
    _run_args(c)
    c.add_argument("--modes", nargs="+", default=["pause", "restart"], choices=["pause", "restart"])
    c.add_argument("--serve-args", default="", help="extra `triton-pd serve` arguments for both servers (quoted)")
    c.add_argument("--layout", choices=["one", "split"], default="one",
                   help="one tritonserver per mode, or prefill, decode and master in servers of their own")  # fmt: skip
    c.add_argument("--prefill-serve-args", default="", help="split: options of the prefill server only")
    c.add_argument("--decode-serve-args", default="", help="split: options of the decode server only")
    c.set_defaults(func=cmd_compare)
    pa = b.add_parser("to-perf-analyzer", help="write perf_analyzer --input-data and --request-intervals files")
    _trace_args(pa)
    pa.add_argument("--out", required=True)
    pa.add_argument("--url", default="127.0.0.1:8001")
    pa.set_defaults(func=cmd_to_pa)


def _prepare(a):
    from . import replay as rp
    from .common.model import loader

    cfg = loader.load_config(loader.resolve(a.model))
    context = a.context or cfg.max_position_embeddings
    shaping = rp.Shaping(
        a.time_scale, a.sample, a.seed, a.start, a.duration, a.max_requests, a.input_scale, a.output_scale,
        a.max_input, a.max_output, context,
    )  # fmt: skip
    reqs, info = rp.shape(rp.load_trace(a.trace, a.seed), shaping)
    if a.conversations:
        reqs = rp.as_conversations(reqs, a.conversations, a.seed, a.input_scale)
        info["conversations"] = a.conversations
    if not reqs:
        raise SystemExit("triton-pd bench: the trace selection is empty")
    info["trace"] = a.trace
    prompts = [rp.build_prompt(r, cfg.vocab_size, a.input_scale, a.seed, i) for i, r in enumerate(reqs)]
    print(
        f"triton-pd bench: {info['requests']} requests over {info['span_s']:.1f} s; inputs x{a.input_scale}, "
        f"outputs x{a.output_scale}, "
        f"{info['inputs_clipped']} inputs and {info['outputs_clipped']} outputs clipped (context {context})",
        flush=True,
    )
    return rp, reqs, prompts, info


def _report(rp, out: Path, runs: dict, infos: dict, plots: bool, cmd: str) -> str:
    summaries = {n: rp.summarize(recs, samples, wall) for n, (recs, samples, wall) in runs.items()}
    for n, (recs, samples, _) in runs.items():
        rp.write_run(out, n, recs, samples, summaries[n], infos[n])
    info = next(iter(infos.values()))
    lines = [
        "# Trace replay",
        "",
        f"Command: `{cmd}`",
        "",
        f"Trace `{info['trace']}`: {info['requests']} requests over {info['span_s']:.1f} s (time scale "
        f"{info['time_scale']}, sample {info['sample']}); inputs scaled x{info['input_scale']}, outputs "
        f"x{info['output_scale']}, "
        f"{info['inputs_clipped']} inputs clipped (max {info['max_input']}), {info['outputs_clipped']} outputs clipped "
        f"(max {info['max_output']}), context {info['context']}.",
        "",
        rp.table(summaries),
        "",
        "TTFT counts from the moment the request was sent; TPOT is (last token - first token) / (tokens - 1) per "
        "answer; the largest gap is the longest wait between two consecutive tokens of one answer.",
    ]
    for n, summ in summaries.items():
        for kind, msgs in summ.get("error_messages", {}).items():
            lines.append("")
            lines.append(f"Errors of kind `{kind}` in `{n}` (most frequent messages):")
            lines += [f"- {count} x `{msg[:300]}`" for msg, count in msgs]
    (out / "report.md").write_text("\n".join(lines) + "\n")  # the numbers first, whatever the plots do
    if plots:
        try:
            files = rp.plots({n: (recs, samples) for n, (recs, samples, _) in runs.items()}, out)
            lines += ["", "Plots: " + ", ".join(f"[{f}]({f})" for f in files)]
        except Exception as e:
            lines += ["", f"Plots failed: {e!r}"]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text


def _run_limit(a, info: dict) -> float:
    return a.run_limit if a.run_limit is not None else info["span_s"] + a.timeout


def _command() -> str:
    return "triton-pd " + shlex.join(sys.argv[1:])


def cmd_replay(a) -> int:
    rp, reqs, prompts, info = _prepare(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    recs, samples, wall = rp.replay(
        a.url, a.metrics_url or None, reqs, prompts, a.max_users, a.timeout,
        run_limit=_run_limit(a, info), stuck_after=a.stuck_after,
    )  # fmt: skip
    print(_report(rp, out, {a.name: (recs, samples, wall)}, {a.name: info}, not a.no_plots, _command()))
    return 0


def cmd_compare(a) -> int:
    rp, reqs, prompts, info = _prepare(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs, infos = {}, {}
    for mode in a.modes:
        print(f"triton-pd bench: starting a server with --on-decode-oom {mode}", flush=True)
        try:
            server = start_deployment(
                a.layout, ["--model", a.model, "--on-decode-oom", mode, *shlex.split(a.serve_args)],
                out / (f"server-{mode}.log" if a.layout == "one" else f"servers-{mode}"),
                a.prefill_serve_args, a.decode_serve_args,
            )  # fmt: skip
        except ServerError as e:
            raise SystemExit(f"triton-pd bench: {e}") from None
        try:
            runs[mode] = rp.replay(
                f"127.0.0.1:{server.grpc}", f"127.0.0.1:{server.metrics}", reqs, prompts, a.max_users, a.timeout,
                run_limit=_run_limit(a, info), stuck_after=a.stuck_after,
            )  # fmt: skip
        finally:
            server.stop()
        infos[mode] = info
        _report(rp, out, runs, infos, False, _command())  # keep what is measured if a later run fails
    print(_report(rp, out, runs, infos, not a.no_plots, _command()))
    return 0


def cmd_to_pa(a) -> int:
    rp, reqs, prompts, info = _prepare(a)
    out = Path(a.out)
    inp, iv = rp.to_perf_analyzer(reqs, prompts, out)
    print(f"wrote {inp} and {iv}; drive the server with:")
    print(rp.perf_analyzer_command(a.url, inp, iv, len(reqs), out))
    return 0
