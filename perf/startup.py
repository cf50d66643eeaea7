"""Start-up time of a decode instance: load the weights, allocate the pools, compile the kernels, tune the
projections and capture every decode graph, as a decode server does before it reports ready.

Three starts in fresh processes, each measured against the others in the same run:

    cold    an empty Triton kernel cache and an empty tuning cache (a fresh GPU host: every kernel compiled and
            every projection timed)
    picks   an empty Triton kernel cache, the tuning picks shipped in perf/tune_cache/ (compiled, not timed,
            where the GPU model has picks there), or with `--picks cold` the picks the cold start left
    warm    both caches as `cold` left them (a restart on the same host)

    python perf/startup.py --model random:qwen3.5-9b [--kv-tokens 8192] [--max-batch 256] [--out FILE.json]
                           [--keep DIR]

Each start has a wall-clock bound (--start-limit); a start that runs past it is recorded as such and the run goes
on. Each start's progress lines (stderr: the tuning of each graph size, the capture) go to DIR/startup-NAME.log and
its tuning files to DIR/NAME/ with --keep: a cold start's files are the picks perf/tune_cache/ takes for that GPU.
Needs a CUDA GPU (the CPU path captures nothing)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
from backends.common.engine.runner import ModelRunner
from kernels import linear
t1 = time.perf_counter()
r = ModelRunner(sys.argv[1], "bfloat16", "cuda", int(sys.argv[2]), max_batch=int(sys.argv[3]))
torch.cuda.synchronize()
t2 = time.perf_counter()
c = linear.tune_cache()
print("STARTUP " + json.dumps({"import_s": t1 - t0, "load_capture_s": t2 - t1, "total_s": t2 - t0,
      "tune_hits": c.hits, "tune_misses": c.misses, "gpu": torch.cuda.get_device_name()}))
"""


def start(name: str, model: str, kv: int, batch: int, triton_cache: Path, tune_file: Path, limit: float,
          log: Path) -> dict:  # fmt: skip
    """One start in a fresh process; its stderr (progress lines) goes to `log`, written as it runs."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(triton_cache), TRITON_PD_TUNE_CACHE=str(tune_file),
               PYTHONUNBUFFERED="1")  # fmt: skip
    t = time.perf_counter()
    with open(log, "w") as err:
        try:
            p = subprocess.run([sys.executable, "-c", CHILD, model, str(kv), str(batch)], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=err, text=True, timeout=limit)  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"start": name, "error": f"ran past {limit:.0f} s"}
    row = {"start": name, "wall_s": time.perf_counter() - t}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("STARTUP ")]
    if p.returncode != 0 or not lines:
        return dict(row, error=f"exit {p.returncode}: {log.read_text(errors='replace').strip()[-600:]}")
    return dict(row, **json.loads(lines[-1][len("STARTUP ") :]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:qwen3.5-9b")
    ap.add_argument("--kv-tokens", type=int, default=8192)
    ap.add_argument("--max-batch", type=int, default=256, help="decode's default: graphs up to this batch")
    ap.add_argument("--starts", nargs="+", default=["cold", "picks", "warm"], choices=["cold", "picks", "warm"])
    ap.add_argument("--start-limit", type=float, default=240, help="seconds one start may take")
    ap.add_argument("--out", default=None, help="JSON rows, rewritten after every start")
    ap.add_argument("--picks", default=str(ROOT / "perf" / "tune_cache"),
                    help="folder of the picks start's tuning files (linear-tune.json, delta-tune.json), or 'cold': "
                    "those the cold start before it left")  # fmt: skip
    ap.add_argument("--keep", default=None, help="folder for each start's log and tuning files")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="triton-pd-startup-"))
    keep = Path(a.keep) if a.keep else work
    keep.mkdir(parents=True, exist_ok=True)
    shipped = (work / "cold" if a.picks == "cold" else Path(a.picks)) / "linear-tune.json"
    rows = []
    for name in a.starts:
        if name == "cold":
            cache, tune = work / "cold-triton", work / "cold" / "linear-tune.json"
        elif name == "warm":  # cold's caches, as cold left them
            cache, tune = work / "cold-triton", work / "cold" / "linear-tune.json"
        else:
            cache, tune = work / "picks-triton", work / "picks" / "linear-tune.json"
        tune.parent.mkdir(parents=True, exist_ok=True)
        if name == "picks":
            for f in ("linear-tune.json", "delta-tune.json"):
                if shipped.with_name(f).exists():
                    shutil.copy(shipped.with_name(f), tune.with_name(f))
        row = start(name, a.model, a.kv_tokens, a.max_batch, cache, tune, a.start_limit, keep / f"startup-{name}.log")
        if a.keep:  # the tuning files as this start left them (a start past its limit: what it had written)
            (keep / name).mkdir(exist_ok=True)
            for f in tune.parent.glob("*-tune.json"):
                shutil.copy(f, keep / name / f.name)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps({"model": a.model, "kv_tokens": a.kv_tokens, "max_batch": a.max_batch,
                                               "rows": rows}, indent=1))  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
