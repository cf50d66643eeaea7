#!/usr/bin/env bash
# run 3: add + RMSNorm reading the residual and weight before the PDL wait (preload) in the hybrid graphs, A/B with HEAD (before/)
set -uo pipefail
OUT=$1; W=$OUT/files; mkdir -p $W/before
cp perf/tune_cache/*.json $W/; cp .gpu/before/perf/tune_cache/*.json $W/before/; chmod u+w $W/*.json $W/before/*.json
export PYTHONUNBUFFERED=1
trap 'rm -f $W/*.lock $W/before/*.lock; tar -czf $OUT/files.tgz -C $W .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
st() { local n=$1 l=$2; shift 2; echo "== $n $(date +%T)"; timeout -k 5 $l "$@" > $W/$n.log 2>&1; echo "   exit $?"; grep "qwen3.*| [0-9]* |" $W/$n.log | sort -u | cut -c1-110; }
B="python3 -m perf.hybrid_bench --prefill 0 --reps 20 --eager-batches"
L="--models random:qwen3-next-layout --batches 1 32 128"
ROOT=$PWD
st before1 45 bash -c "cd .gpu/before && TRITON_PD_TUNE_CACHE=$W/before/linear-tune.json $B $L --time-limit 40 --out $W/before1.md"
st after1 200 env TRITON_PD_TUNE_CACHE=$W/linear-tune.json $B $L --time-limit 190 --out $W/after1.md
st before2 40 bash -c "cd .gpu/before && TRITON_PD_TUNE_CACHE=$W/before/linear-tune.json $B $L --time-limit 35 --out $W/before2.md"
st after2 40 env TRITON_PD_TUNE_CACHE=$W/linear-tune.json $B $L --time-limit 35 --out $W/after2.md
st ktests 60 env TRITON_PD_TUNE_CACHE=$W/linear-tune.json python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_hybrid.py tests/kernels/test_kernels.py -k "add_rms_norm or graph_decode_steps or fused_prologues or deferred"
st qwen35 180 env TRITON_PD_TUNE_CACHE=$W/linear-tune.json $B --models random:qwen3.5-9b --batches 1 32 128 --time-limit 172 --out $W/qwen35.md
