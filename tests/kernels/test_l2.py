"""kernels.l2: which launches ask for which bytes, and the kernels that ask compile for an H200 (sm_90) with
Triton's own ptxas, without a GPU. Whether asking pays is for perf/hybrid_bench.py on the H200 to show."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels import l2  # noqa: E402


def test_off_without_a_cuda_device_or_a_weight():
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert l2.mode(w.device) == ""
    off = l2.args(w, w)
    assert off["PF_ON"] is False and off["PF_BYTES"] == 0 and off["PF"] is w
    x = torch.zeros(4)
    assert l2.args(None, x) == {"PF": x, "PF_BYTES": 0, "PF_ON": False}


@pytest.mark.parametrize("mode", ["on", "all"])
def test_what_a_launch_asks_for(monkeypatch, mode):
    monkeypatch.setattr(l2, "mode", lambda device: mode)
    monkeypatch.setenv("TRITON_PD_L2_PREFETCH_MB", "1")
    x = torch.zeros(4)
    small = torch.zeros(100, 3, dtype=torch.bfloat16)  # 600 bytes: 592 asked (a multiple of 16)
    big = torch.zeros(1024, 1024, dtype=torch.bfloat16)  # 2 MiB: the 1 MiB budget
    assert l2.args(small, x) == {"PF": small, "PF_BYTES": 592, "PF_ON": True}
    assert l2.args(big, x)["PF_BYTES"] == 2**20
    # skinny_linear asks only when every launch does
    assert l2.args(small, x, min_mode="all")["PF_ON"] is (mode == "all")
    # a strided view is not one run of bytes
    assert l2.args(big[:, ::2], x)["PF_ON"] is False


@pytest.mark.slow
def test_the_asking_kernels_compile_for_sm90_with_the_prefetch():
    """PTX with bulk L2 prefetches (and the PDL wait) in the gated delta step, the decode attention, the MoE route
    (the chosen experts' gate/up weights) and skinny_linear as GpuHybrid launches them with TRITON_PD_L2_PREFETCH
    set, none without it; compiled in a process of its own (TRITON_INTERPRET unset: the tests' conftest sets it
    without a GPU)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.kernels.sm90_compile"], capture_output=True, text=True,
                         env=env, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(counts) == {"_gated_delta_step_kernel", "_decode_kernel", "_router_kernel", "_skinny_kernel"}
    for name, c in counts.items():
        assert c["on"]["prefetch"] >= 1 and c["on"]["wait"] == 1, (name, c)
        assert c["off"]["prefetch"] == 0 and c["off"]["wait"] == 1, (name, c)
