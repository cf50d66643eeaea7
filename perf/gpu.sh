#!/usr/bin/env bash
# The benchmarks' runs on one GPU host, each step bounded in wall clock and every mode within one device command
# (600 s), results under OUT: the reports (.md, .json) and every file of the run in OUT/files.tgz (logs, JSON rows,
# tuning caches), few files for a device tool that returns only a few:
#   bash perf/gpu.sh OUT bench|startup|vision|fp8|seed|seed-mtp|seed-dense|soak-policies [PHASE]
# bench:   the hybrid kernel tests, then `perf/engine.py hybrid`: the decode step at batch 1, 32 and 128 for
#          random:qwen3-next-layout (with --profile) and random:qwen3.5-9b against their rooflines, tuned on the
#          measured graph sizes; the device host's python3, no bundle. The kernel tests compile cold on a fresh
#          machine and their 120 s can run out on an H100: run them as a command of their own where all must run;
# startup: `perf/startup.py`: a decode instance of random:qwen3.5-9b started cold (no kernel or tuning cache: its
#          tuning files, every graph size's picks, go in the archive's cold/ for perf/tune_cache/), then as a fresh
#          host with those picks (no kernel cache); each start's progress log too; the host's python3;
# vision:  `perf/engine.py vision`: Qwen3.5's vision tower against transformers' Qwen3_5VisionModel (sdpa, bf16)
#          at 448 and 1,344 pixels, one and four images; the host's python3;
# fp8:     `perf/engine.py fp8`: the W8A8 matmul against cuBLAS FP8 (torch._scaled_mm) and bf16, then the decode
#          step (batch 1, 32, 128) and an 8,192-token prefill of random:llama3.1-8b-fp8 against its roofline and
#          the 16-bit model; the host's python3;
# seed:    the seed scenario (`perf/scenario.py seed`) with random:qwen3.5-9b at serve's defaults, rotate against
#          plain in one run, through the offline bundle (`triton-pd bundle .bundle`, carried);
# seed-mtp: seed with --speculative mtp on both servers (the MTP head's verify steps);
# seed-dense: the same as seed with the dense random:llama3.1-8b.
# soak-policies: `perf/soak.py policies`: the H200 soak's load (random:llama3.1-8b, 16,384-token pool, --max-batch
#          64, 30% long answers of ~1,500 tokens, 20% cancelled) against rotate, plain and restart in one run, one
#          server each, 60 s measured after 15 s of warm-up; PHASE: the users (64 by default; 16 and 128 too).
# PHASE: the seed phase (--phases): 3x5500 (default) or 4x4000.
# The tuning caches (linear-tune.json, delta-tune.json) start from perf/tune_cache/'s and go in the archive unless
# TRITON_PD_TUNE_CACHE names a file (the delta step's cache sits beside it): see perf/tune_cache/README.md.
set -uo pipefail
OUT=${1:?OUT folder}
WHAT=${2:?bench, startup, vision, fp8, seed, seed-mtp, seed-dense or soak-policies}
PHASE=${3:-3x5500}
case "$WHAT" in bench|startup|vision|fp8|seed|seed-mtp|seed-dense|soak-policies) ;; *) echo "gpu.sh: bench, startup, vision, fp8, seed, seed-mtp, seed-dense or soak-policies, not $WHAT" >&2; exit 2 ;; esac
W="$OUT/files"
mkdir -p "$W"
if [ -z "${TRITON_PD_TUNE_CACHE:-}" ]; then
  cp perf/tune_cache/linear-tune.json perf/tune_cache/delta-tune.json "$W/" 2>/dev/null
  chmod u+w "$W"/*.json 2>/dev/null
fi
export PYTHONUNBUFFERED=1 TRITON_PD_TUNE_CACHE="${TRITON_PD_TUNE_CACHE:-$W/linear-tune.json}"
step() {  # name, wall limit (s), command...
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T), limit ${limit}s)"
  timeout -k 10 "$limit" "$@" > "$W/$name.log" 2>&1
  echo "   exit $?"
  grep -v "graph of [0-9]*, " "$W/$name.log" | tail -n 30
}
pack() {  # the reports beside the archive of everything, Triton's own logs of the servers started included
  cp "$W"/*.md "$OUT/" 2>/dev/null
  for f in .run/*/tritonserver.log; do [ -f "$f" ] && cp "$f" "$W/tritonserver-$(basename "$(dirname "$f")").log"; done
  rm -f "$W"/*.lock
  tar -czf "$OUT/files.tgz" -C "$W" . && rm -rf "$W"
}
trap pack EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
case "$WHAT" in
  bench)
    step kernel_tests 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_hybrid.py tests/kernels/test_gpu_model.py \
      tests/kernels/test_kernels.py -k "gated_delta_step or tune_step or step_candidates or fused_prologues or \
      verify_and_mtp or tune_kernels or conv_epilogue or deferred or norm_epilogue or add_rms_norm"
    step layout 200 python3 perf/engine.py hybrid --models random:qwen3-next-layout --batches 1 32 128 --prefill 0 \
      --reps 20 --eager-batches --profile --time-limit 185 --out "$W/layout.md"
    step qwen35 185 python3 perf/engine.py hybrid --models random:qwen3.5-9b --batches 1 32 128 --prefill 0 \
      --reps 20 --eager-batches --time-limit 170 --out "$W/qwen35.md"
    ;;
  startup)
    step startup_cold 330 python3 perf/startup.py --model random:qwen3.5-9b --starts cold --start-limit 320 \
      --keep "$W" --out "$W/startup-cold.json"
    step startup_picks 240 python3 perf/startup.py --model random:qwen3.5-9b --starts picks --picks "$W/cold" \
      --start-limit 230 --keep "$W" --out "$W/startup-picks.json"
    cp "$W"/startup-*.json "$OUT/" 2>/dev/null
    ;;
  vision)
    step vision 300 python3 perf/engine.py vision --sizes 448 1344 --images 1 4 --reps 10 --time-limit 280 \
      --out "$W/vision.md"
    ;;
  fp8)
    step fp8 570 python3 perf/engine.py fp8 --models random:llama3.1-8b-fp8 --time-limit 550 --out "$W/fp8.md"
    ;;
  seed)
    step seed 570 bash .bundle/bootstrap.sh python3 perf/scenario.py seed --out /tmp/hybrid_gpu_seed \
      --model random:qwen3.5-9b --serve-args "--device gpu" --policies rotate plain \
      --phases $PHASE --phase-limit 75 --time-limit 540
    cp /tmp/hybrid_gpu_seed/report.md /tmp/hybrid_gpu_seed/summary.json /tmp/hybrid_gpu_seed/server-*.log "$W/" 2>/dev/null
    ;;
  seed-mtp)
    step seed_mtp 570 bash .bundle/bootstrap.sh python3 perf/scenario.py seed --out /tmp/hybrid_gpu_seed_mtp \
      --model random:qwen3.5-9b --serve-args "--device gpu --speculative mtp" \
      --policies rotate plain --phases $PHASE --phase-limit 95 --time-limit 540
    cp /tmp/hybrid_gpu_seed_mtp/report.md "$W/report_mtp.md" 2>/dev/null
    cp /tmp/hybrid_gpu_seed_mtp/summary.json "$W/summary_mtp.json" 2>/dev/null
    ;;
  seed-dense)
    step seed_dense 570 bash .bundle/bootstrap.sh python3 perf/scenario.py seed --out /tmp/hybrid_gpu_seed_dense \
      --model random:llama3.1-8b --serve-args "--device gpu" --policies rotate plain \
      --phases $PHASE --phase-limit 60 --time-limit 540
    cp /tmp/hybrid_gpu_seed_dense/report.md "$W/report_dense.md" 2>/dev/null
    cp /tmp/hybrid_gpu_seed_dense/summary.json "$W/summary_dense.json" 2>/dev/null
    ;;
  soak-policies)
    USERS=${3:-64}
    step soak_policies 575 bash .bundle/bootstrap.sh python3 perf/soak.py policies --users "$USERS" \
      --duration 75 --warmup 15 --drain-timeout 15 --start-allowance 60 --deadline 470 --long-tokens 1500 \
      --short-tokens 64 --model random:llama3.1-8b --serve-args "--device gpu --kv-tokens 16384 --max-batch 64" \
      --out "$W/soak_policies_$USERS"
    cp "$W/soak_policies_$USERS/soak_policies.md" "$W/soak_policies_$USERS.md" 2>/dev/null
    ;;
esac
