#!/usr/bin/env bash
set -uo pipefail
OUT=$1; W=$OUT/files; mkdir -p $W/before
cp .gpu/after-linear-tune.json $W/linear-tune.json; cp perf/tune_cache/delta-tune.json $W/; cp .gpu/before/perf/tune_cache/*.json $W/before/; chmod u+w $W/*.json $W/before/*.json
export PYTHONUNBUFFERED=1
trap 'rm -f $W/*.lock $W/before/*.lock; tar -czf $OUT/files.tgz -C $W .' EXIT
st() { local n=$1 l=$2; shift 2; echo "== $n $(date +%T)"; timeout -k 5 $l "$@" > $W/$n.log 2>&1; echo "   exit $?"; grep "qwen3.*| [0-9]* |" $W/$n.log | sort -u | cut -c1-110; }
B="python3 -m perf.hybrid_bench --prefill 0 --reps 20 --eager-batches"
L="--models random:qwen3-next-layout --batches 1 32 128"
Q="--models random:qwen3.5-9b --batches 1 32 128"
st before1 45 bash -c "cd .gpu/before && TRITON_PD_TUNE_CACHE=$W/before/linear-tune.json $B $L --time-limit 40 --out $W/before1.md"
st after1 45 env TRITON_PD_TUNE_CACHE=$W/linear-tune.json $B $L --time-limit 40 --out $W/after1.md
st before2 40 bash -c "cd .gpu/before && TRITON_PD_TUNE_CACHE=$W/before/linear-tune.json $B $L --time-limit 35 --out $W/before2.md"
st after2 40 env TRITON_PD_TUNE_CACHE=$W/linear-tune.json $B $L --time-limit 35 --out $W/after2.md
st ktests 110 env TRITON_PD_TUNE_CACHE=$W/linear-tune.json python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_hybrid.py -k "add_rms_norm or graph_decode_steps or fused_prologues"
st qbefore 50 bash -c "cd .gpu/before && TRITON_PD_TUNE_CACHE=$W/before/linear-tune.json $B $Q --time-limit 45 --out $W/qbefore.md"
st qafter 50 env TRITON_PD_TUNE_CACHE=$W/linear-tune.json $B $Q --time-limit 45 --out $W/qafter.md
