"""`perf/kernels.py prefill-attention` runs end to end at a tiny size (without a GPU through Triton's interpreter): the
report lists the reference and the kernel with the slots in order and scattered, and the kernel agrees with the
reference."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("triton")

from perf.tools import prefill_attention_bench  # noqa: E402


def test_report_lists_the_reference_and_both_slot_orders(tmp_path):
    out = tmp_path / "report.md"
    args = ["--tokens", "80", "--reps", "1", "--shapes", "layout", "--out", str(out)]
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py sets it without a GPU
        args.append("--cpu")
    assert prefill_attention_bench.main(args) == 0
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [r["what"] for r in rows] == ["sdpa", "kernel in order", "kernel scattered"]
    tol = 1e-4 if "--cpu" in args else 3e-2  # float32 in the interpreter, bf16 on a GPU
    assert all(r["diff"] < tol and r["s"] > 0 for r in rows[1:])
    assert "Measured" in out.read_text()
