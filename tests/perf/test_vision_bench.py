"""`perf/engine.py vision` runs end to end at a tiny size on the CPU: both towers timed, their rows equal."""

from __future__ import annotations

import json

from perf.tools import vision_bench


def test_both_towers_are_timed_and_agree(tmp_path):
    out = tmp_path / "vision.md"
    args = ["--cpu", "--sizes", "64", "--images", "1", "2", "--reps", "1", "--out", str(out)]
    assert vision_bench.main(args) == 0
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [(r["images"], r["tokens"]) for r in rows] == [(1, 4), (2, 8)]  # 64 x 64: 4 x 4 patches, 2 x 2 merged
    assert all(r["ours_s"] > 0 and r["hf_s"] > 0 and r["max_diff"] < 1e-4 for r in rows)
    assert "ours / transformers" in out.read_text() and "Measured" in out.read_text()
