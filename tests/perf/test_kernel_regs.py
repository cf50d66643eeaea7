"""perf/kernel_regs on a machine without a GPU: the delta step's first candidate compiles for sm_90 and reports its
registers and spills (in a process of their own: the tests run Triton's interpreter, which does not compile, and
the tool says so when it is set)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_candidates_compile_for_sm90_and_report_registers_and_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "regs.md"
    subprocess.run([sys.executable, "-m", "perf.tools.kernel_regs", "--first", "1", "--out", str(out), "--time-limit",
                    "120"], env=env, check=True, capture_output=True, timeout=180)  # fmt: skip
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [r["setting"] for r in rows] == [{"block_v": 128}] and not rows[0]["conv"]
    assert 0 < rows[0]["REG"] <= 255 and rows[0]["STACK"] >= 0
    assert "| {'block_v': 128} | no | 4 |" in out.read_text()
    interpreted = subprocess.run([sys.executable, "-m", "perf.tools.kernel_regs", "--first", "1"], capture_output=True,
                                 text=True, env=dict(env, TRITON_INTERPRET="1"), timeout=120)  # fmt: skip
    assert interpreted.returncode == 2 and "unset it" in interpreted.stderr


@pytest.mark.slow  # `make test` only: too long for `make test-fast`
def test_skinny_in_proj_tiles_compile_with_and_without_the_conv_epilogue(tmp_path):
    """--skinny: skinny_linear's first tensor-core tile compiles for sm_90 plain and with the conv epilogue, each
    with its registers; one row is refused (the tool compiles the tensor-core path)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "skinny.md"
    command = ["--skinny", "--rows", "32", "--first", "1", "--out", str(out), "--time-limit", "150"]
    subprocess.run([sys.executable, "-m", "perf.tools.kernel_regs", *command], env=env, check=True, capture_output=True,
                   timeout=200)  # fmt: skip
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [r["conv"] for r in rows] == ["no", "epilogue"]
    assert all(r["block_n"] == 32 and 0 < r["REG"] <= 255 for r in rows)
    assert rows[1]["REG"] > rows[0]["REG"]  # the conv's tiles cost registers beside the product's
    one = subprocess.run([sys.executable, "-m", "perf.tools.kernel_regs", "--skinny", "--rows", "1"],
                         capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert one.returncode == 2 and "--rows 2 or more" in one.stderr


# the hybrid decode graph's gated decode attention (split-KV and not; with rope and the K/V store) and its norm
# reading the residual before the PDL wait, compiled for sm_90 with perf.kernel_regs.resource_use: Triton's
# interpreter, which the other tests run, accepts kernels that its compiler refuses (a helper returning a tensor in
# one branch and a float in another); skinny_linear's fused norm with glu, preload and prefetch; the fused MoE's
# FP8 grouped GEMMs at their launch settings
COMPILE_HYBRID = """
import json
from kernels import attention, norm
from perf.tools.kernel_regs import resource_use

attn = {n: "*bf16" for n in ("Q", "K", "V", "O", "KNew", "VNew", "Gate")}
attn |= {n: "*fp32" for n in ("MidO", "MidL", "Cos", "Sin")}
attn |= {n: "*i32" for n in ("Table", "Rows", "SeqLens", "QIdx", "Counter", "OutSlots")}
use = {}
for splits, fused in ((1, False), (8, False), (8, True)):
    consts = dict(GROUP=8, BLOCK_G=16, D=256, BLOCK_N=32, NUM_SPLITS=splits, BLOCK_S=max(2, splits), MERGE_G=8,
                  PREC="tf32", FUSE_ROPE=fused, GATE=True, PDL=True)
    use[f"attention {splits}" + (" rope" if fused else "")] = resource_use(attention._decode_kernel, consts, 4, 90, 2,
                                                                          attn, set())
consts = dict(HAS_RES=True, BLOCK=2048, OFFSET=True, PARTS=4, PRELOAD=True, PDL=True)
pointers = {"X": "*fp32", "R": "*bf16", "W": "*bf16", "Out": "*bf16"}
use["norm"] = resource_use(norm._add_rms_norm_kernel, consts, 8, 90, None, pointers, set())
from kernels import linear
from perf.tools.kernel_regs import SKINNY_ALIGNED, SKINNY_PLAIN, SKINNY_POINTERS

consts = dict(SKINNY_PLAIN, BLOCK_M=32, NORM=True, HAS_RES=True, PRELOAD=True, K_FIRST=128, GLU=True, PREFETCH=True)
use["skinny norm"] = resource_use(linear._skinny_kernel, consts, 4, 90, 3, SKINNY_POINTERS, SKINNY_ALIGNED)
from kernels import moe

pointers = {"X": "*bf16", "W": "*fp8e4nv", "WS": "*fp32", "Inter": "*bf16", "Wt": "*bf16", "Out": "*fp32",
            "Pairs": "*i32", "BlockExpert": "*i32"}
consts = dict(K_TOP=8, BM=moe.BLOCK_M, BN=moe.SETTINGS["fp8_bn"], BK=128, FP8=True, PDL=True)
use["moe fp8 gate_up"] = resource_use(moe._gate_up_kernel, consts, moe.SETTINGS["warps"], 90,
                                      moe.SETTINGS["stages"], pointers, set())
consts = dict(BM=moe.BLOCK_M, BN=moe.SETTINGS["down_bn"], BK=128, FP8=True, PDL=True)
use["moe fp8 down"] = resource_use(moe._down_kernel, consts, moe.SETTINGS["down_warps"], 90,
                                   moe.SETTINGS["down_stages"], pointers, set())
print(json.dumps(use))
"""


def test_the_hybrid_graphs_kernels_and_the_fp8_moe_gemms_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_HYBRID], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    use = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(use) == ["attention 1", "attention 8", "attention 8 rope", "moe fp8 down", "moe fp8 gate_up",
                           "norm", "skinny norm"]  # fmt: skip
    assert all(0 < u["REG"] <= 255 for u in use.values()), use
    assert use["moe fp8 gate_up"]["STACK"] == 0 and use["moe fp8 down"]["STACK"] == 0, use  # no spills
