"""The replay benchmark end to end on the CPU: a short slice of the Mooncake trace against a real server whose
decode pool is far too small for it, so answers pause and recover; the report must account for every request."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import ROOT, Server

# rows 17-40 of the Mooncake trace (tests/perf/data/README.md)
TRACE = Path(__file__).parent / "perf" / "data" / "mooncake_slice.jsonl"
pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_replay_smoke_pauses(tmp_path: Path):
    assert TRACE.exists(), f"trace not found at {TRACE}"
    server = Server("--kv-tokens", "400", "--max-batch", "16", name="replay")
    try:
        out = tmp_path / "replay"
        cmd = [
            sys.executable, "-m", "backends.cli", "bench", "replay", "--trace", str(TRACE),
            "--max-requests", "8", "--time-scale", "0.05", "--input-scale", "0.01", "--max-input", "96",
            "--max-output", "48",
            "--url", server.grpc_url, "--metrics-url", f"127.0.0.1:{server.metrics}", "--out", str(out),
            "--name", "pause",
        ]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        s = json.loads((out / "pause.summary.json").read_text())["summary"]
        assert s["requests"] == 8 and s["success_rate"] == 1.0, s
        assert s["pauses"] > 0, s
        recovered = s["recoveries_local"] + s["recoveries_host"] + s["recoveries_prefill"]
        assert recovered >= s["pauses"] - s["max_paused"], s
        recs = [json.loads(line) for line in (out / "pause.records.jsonl").read_text().splitlines()]
        assert len(recs) == 8
        for r in recs:  # every answer whole: as many tokens as asked for, times never going backwards
            assert r["error"] is None and len(r["token_times"]) == r["output_len"], r
            assert r["token_times"] == sorted(r["token_times"]) and r["token_times"][0] >= r["sent"]
        assert s["max_gap"] > 0 and s["ttft_p50"] > 0 and s["output_tok_s"] > 0
        report = (out / "report.md").read_text()
        assert "| pauses |" in report and "TTFT P50" in report
        for png in ("ttft_cdf.png", "tpot_cdf.png", "kv_timeline.png", "token_timelines.png"):
            assert (out / png).stat().st_size > 1000
        assert len((out / "pause.metrics.jsonl").read_text().splitlines()) >= 2
        server.assert_released(timeout=5)
    finally:
        server.stop()
