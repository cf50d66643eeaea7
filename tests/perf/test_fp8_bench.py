"""`perf/engine.py fp8 --cpu` runs its matmul section end to end in Triton's interpreter and writes its table."""

from __future__ import annotations

import json

from perf.tools import fp8_bench


def test_the_matmul_section_runs_and_writes_its_rows(tmp_path):
    out = tmp_path / "fp8.md"
    assert fp8_bench.main(["--cpu", "--rows", "1", "--reps", "1", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [r["proj"] for r in rows] == ["qkv", "o", "gate_up", "down"]
    assert all(r["ours"] > 0 and r["bf16"] > 0 and r["cublas_fp8"] is None for r in rows)
    assert "ours / cuBLAS FP8" in out.read_text() and "Measured" in out.read_text()
