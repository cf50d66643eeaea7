"""Registers per thread and spilled bytes of the gated delta step's tuning candidates (kernels.delta_tune), compiled
for an NVIDIA GPU without one: Triton's NVIDIA backend and its ptxas build each variant for the target
architecture, specialised as a launch would be (pointers 16-byte aligned, Qwen3-Next's strides and offsets
multiples of 16), and cuobjdump reads the cubin's resource use. A variant that spills (STACK above 0) keeps part
of its state block in local memory; one that uses many registers has fewer programs resident per SM. Neither is a
time: the GPU's timing at capture (kernels.delta_tune.tune_step) decides; this says which candidates are worth a
compile there, from a machine without a GPU.

    .venv/bin/python -m perf.kernel_regs [--arch 90] [--rows 1] [--first N] [--out FILE.md]

The device host's triton may be another version than this environment's: point PYTHONPATH at a folder with that
version installed first (pip install --target DIR triton==X.Y.Z) to compile as it would; the report names the
version that compiled."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from perf.limits import report_writer, wall_clock_limit

POINTERS_32 = {"Mixed", "ALog", "DtBias", "S", "Part", "CS"}
POINTERS_16 = {"Proj", "NormW", "Out", "CW"}
POINTERS_I32 = {"Pages", "OutPages", "Ctr", "KCtr"}
FLOATS = {"eps", "q_scale"}
# the integer arguments a launch specialises as multiples of 16 at Qwen3-Next's shapes (strides, column offsets)
ALIGNED_INTS = {"stride_m", "stride_p", "stride_out", "s_page", "s_head", "s_k", "z_off", "b_off", "a_off", "cs_page"}


def resource_use(fn, constexprs: dict, num_warps: int, arch: int) -> dict:
    """{"REG": registers per thread, "STACK": bytes per thread, ...} of `fn` compiled for sm_`arch`."""
    import triton
    import triton.backends.nvidia as nv
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def kind(n: str) -> str:
        if n in constexprs:
            return "constexpr"
        if n in POINTERS_32 | POINTERS_16 | POINTERS_I32:
            return "*fp32" if n in POINTERS_32 else "*bf16" if n in POINTERS_16 else "*i32"
        return "fp32" if n in FLOATS else "i32"

    sig = {n: kind(n) for n in fn.arg_names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if sig[n].startswith("*") or n in ALIGNED_INTS
    }
    compiled = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
        out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    use = {}
    for word in " ".join(line for line in out.splitlines() if "REG:" in line).split():
        name, _, value = word.partition(":")
        if value.isdigit():
            use[name] = int(value)
    return use


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 and H200)")
    ap.add_argument("--rows", type=int, default=1, help="sequences: the split candidates are kept for few programs")
    ap.add_argument("--first", type=int, default=None, help="only the first N candidates")
    ap.add_argument("--time-limit", type=float, default=600)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print(
            "kernel_regs: TRITON_INTERPRET=1 makes the kernels interpreted: unset it to compile them", file=sys.stderr
        )
        return 2
    import triton

    from kernels import delta_rule, delta_tune

    HK, HV, DK, DV = 16, 32, 128, 128  # Qwen3-Next's linear-attention heads
    lines = [f"# The gated delta step's candidates compiled for sm_{a.arch} (triton {triton.__version__})", "",
             "Command: `python -m perf.kernel_regs" + "".join(f" {x}" for x in (argv or sys.argv[1:])) + "`.", "",
             "| setting | conv | warps | registers | spilled bytes |", "|---|---|---:|---:|---:|"]  # fmt: skip
    rows: list[dict] = []
    write = report_writer(lines, a.out, rows)
    timer = wall_clock_limit(a.time_limit, write, [])
    plain = delta_tune.step_candidates(a.rows, HV, DV, sms=132)
    for s in (plain + delta_tune.conv_candidates(plain))[: a.first]:
        bv, split = s["block_v"], s.get("split", 1)
        blocks = DV // bv
        warps = s.get("num_warps", 4)
        consts = dict(HV=HV, R=HV // HK, KD=HK * DK, DK=DK, DV=DV, BK=DK, BV=bv, NV=blocks // split, PRELOAD=True,
                      AHEAD=bool(s.get("ahead")) and blocks // split > 1, SPLIT=split, CONV=bool(s.get("conv")),
                      KM1=3, PDL=True)  # fmt: skip
        try:
            use = resource_use(delta_rule._gated_delta_step_kernel, consts, warps, a.arch)
        except Exception as e:  # a variant that does not compile is a finding too
            lines.append(f"| {s} | | {warps} | {e!r:.100} | |")
            continue
        shown = {k: v for k, v in s.items() if k not in ("conv", "num_warps")}
        rows.append(dict(setting=shown, conv=bool(s.get("conv")), warps=warps, **use))
        lines.append(f"| {shown} | {'yes' if s.get('conv') else 'no'} | {warps} | {use.get('REG')} | "
                     f"{use.get('STACK')} |")  # fmt: skip
    timer.cancel()
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
