"""Registers per thread and spilled bytes of the gated delta step's tuning candidates (kernels.delta_tune), or with
--skinny of skinny_linear's tiles for a linear-attention in_proj with and without its conv epilogue, compiled
for an NVIDIA GPU without one: Triton's NVIDIA backend and its ptxas build each variant for the target
architecture, specialised as a launch would be (pointers 16-byte aligned, Qwen3-Next's strides and offsets
multiples of 16), and cuobjdump reads the cubin's resource use. A variant that spills (STACK above 0) keeps part
of its state block in local memory; one that uses many registers has fewer programs resident per SM. Neither is a
time: the GPU's timing at capture (kernels.delta_tune.tune_step) decides; this says which candidates are worth a
compile there, from a machine without a GPU.

    .venv/bin/python perf/kernels.py regs [--arch 90] [--rows 1] [--first N] [--out FILE.md]
    .venv/bin/python perf/kernels.py regs --skinny [--rows 32] [--out FILE.md]

The device host's triton may be another version than this environment's: point PYTHONPATH at a folder with that
version installed first (pip install --target DIR triton==X.Y.Z) to compile as it would; the report names the
version that compiled."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from perf.tools.limits import bounded_report

POINTERS_32 = {"Mixed", "ALog", "DtBias", "S", "Part", "CS"}
POINTERS_16 = {"Proj", "NormW", "Out", "CW"}
POINTERS_I32 = {"Pages", "OutPages", "Ctr", "KCtr"}
FLOATS = {"eps", "q_scale", "scale_log2"}
# the integer arguments a launch specialises as multiples of 16 at Qwen3-Next's shapes (strides, column offsets)
ALIGNED_INTS = {"stride_m", "stride_p", "stride_out", "s_page", "s_head", "s_k", "z_off", "b_off", "a_off", "cs_page"}


# skinny_linear's kernel (kernels.linear._skinny_kernel): its pointers' element types, and the integer arguments a
# launch at Qwen3-Next's in_proj (12,352 x 2,048, conv channels 8,192) specialises as multiples of 16
SKINNY_POINTERS = {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "R": "*bf16", "RO": "*bf16",
                   "NW": "*bf16", "CW": "*bf16", "P": "*fp32", "CS": "*fp32", "Mixed": "*fp32", "C": "*i32",
                   "CPages": "*i32", "COutPages": "*i32"}  # fmt: skip
SKINNY_ALIGNED = {"N", "K", "k_split", "stride_xm", "stride_wn", "stride_ym", "s_mix", "CC", "cs_page"}
# skinny_linear's constexprs for a plain tensor-core launch of up to 16 rows (callers set BLOCK_M and what they fuse)
SKINNY_PLAIN = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, DOT=True, SPLITS=1, GATED=False, NORM=False,
                    HAS_RES=False, BLOCK_H=2048, PRELOAD=False, CONV=False, KM1=3, UNROLL=False,
                    K_FIRST=0, K_SPLIT=0, GLU=False, PDL=True, PREFETCH=False, NORM_TILE=128, DEFER=False)  # fmt: skip
# (block_n, block_k, num_stages) of skinny_linear's tensor-core candidates, 4 warps (kernels.linear.CANDIDATES)
SKINNY_TILES = [(32, 128, 3), (64, 128, 4), (16, 256, 4), (128, 64, 4)]


def resource_use(fn, constexprs: dict, num_warps: int, arch: int, num_stages: int | None = None,
                 pointers: dict | None = None, aligned: set | None = None) -> dict:  # fmt: skip
    """{"REG": registers per thread, "STACK": bytes per thread, ...} of `fn` compiled for sm_`arch`; pointers /
    aligned: its arguments' pointer types and 16-aligned integers (default: the gated delta step's)."""
    import triton
    import triton.backends.nvidia as nv
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if pointers is None:
        pointers = {n: "*fp32" for n in POINTERS_32} | {n: "*bf16" for n in POINTERS_16}
        pointers |= {n: "*i32" for n in POINTERS_I32}
    aligned = ALIGNED_INTS if aligned is None else aligned

    def kind(n: str) -> str:
        if n in constexprs:
            return "constexpr"
        if n in pointers:
            return pointers[n]
        return "fp32" if n in FLOATS else "i32"

    sig = {n: kind(n) for n in fn.arg_names}
    attrs = {
        (i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*") or n in aligned
    }
    options = dict(num_warps=num_warps) | ({} if num_stages is None else dict(num_stages=num_stages))
    compiled = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                              options=options)  # fmt: skip
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
    ap.add_argument("--rows", type=int, default=None,
                    help="sequences (default 1, with --skinny 32); the split candidates are kept for few "
                         "programs")  # fmt: skip
    ap.add_argument("--skinny", action="store_true",
                    help="skinny_linear's tensor-core tiles for an in_proj: plain and with the conv epilogue, instead "
                         "of the delta step's candidates")  # fmt: skip
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

    if a.skinny:
        return skinny(a, argv)
    a.rows = 1 if a.rows is None else a.rows
    from kernels import delta_rule, delta_tune

    HK, HV, DK, DV = 16, 32, 128, 128  # Qwen3-Next's linear-attention heads
    lines = [f"# The gated delta step's candidates compiled for sm_{a.arch} (triton {triton.__version__})", "",
             "Command: `python perf/kernels.py regs" + "".join(f" {x}" for x in (argv or sys.argv[1:])) + "`.", "",
             "| setting | conv | warps | registers | spilled bytes |", "|---|---|---:|---:|---:|"]  # fmt: skip
    rows: list[dict] = []
    write, timer = bounded_report(lines, a.out, rows, a.time_limit)
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


def skinny(a, argv) -> int:
    """--skinny: `SKINNY_TILES` at a.rows rows (tensor cores, no K split, no prologue) without a conv and with the
    conv epilogue."""
    import triton

    from kernels import linear

    rows = 32 if a.rows is None else a.rows
    if rows < 2:
        print("kernel_regs: --skinny compiles the tensor-core path: --rows 2 or more", file=sys.stderr)
        return 2
    command = "python perf/kernels.py regs" + "".join(f" {x}" for x in (argv or sys.argv[1:]))
    lines = [f"# skinny_linear's in_proj tiles at {rows} rows compiled for sm_{a.arch} (triton {triton.__version__})",
             "", f"Command: `{command}`.", "", "| block_n | block_k | stages | conv | registers | spilled bytes |",
             "|---:|---:|---:|---|---:|---:|"]  # fmt: skip
    found: list[dict] = []
    write, timer = bounded_report(lines, a.out, found, a.time_limit)
    base = dict(SKINNY_PLAIN, BLOCK_M=max(16, triton.next_power_of_2(rows)))
    for bn, bk, stages in SKINNY_TILES[: a.first]:
        for conv in ("no", "epilogue"):
            consts = dict(base, BLOCK_N=bn, BLOCK_K=bk, CONV=conv != "no")
            try:
                use = resource_use(linear._skinny_kernel, consts, 4, a.arch, stages, SKINNY_POINTERS, SKINNY_ALIGNED)
            except Exception as e:  # a variant that does not compile is a finding too
                lines.append(f"| {bn} | {bk} | {stages} | {conv} | {e!r:.100} | |")
                continue
            found.append(dict(block_n=bn, block_k=bk, num_stages=stages, conv=conv, **use))
            lines.append(f"| {bn} | {bk} | {stages} | {conv} | {use.get('REG')} | {use.get('STACK')} |")
    timer.cancel()
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
