#!/usr/bin/env bash
# run 2: state store evict_first (A/B TRITON_PD_STATE_STREAM=0), gate read before the count (A/B ATTN_GATE=0), qwen35 cold
set -uo pipefail
OUT=$1; W=$OUT/files; mkdir -p $W
cp perf/tune_cache/*.json $W/; chmod u+w $W/*.json
export PYTHONUNBUFFERED=1 TRITON_PD_TUNE_CACHE=$W/linear-tune.json
trap 'rm -f $W/*.lock; tar -czf $OUT/files.tgz -C $W .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
st() { local n=$1 l=$2; shift 2; echo "== $n $(date +%T)"; timeout -k 5 $l "$@" > $W/$n.log 2>&1; echo "   exit $?"; grep "qwen3.*| [0-9]* |" $W/$n.log | sort -u | cut -c1-120; }
B="python3 -m perf.hybrid_bench --prefill 0 --reps 20 --eager-batches"
st layout 120 $B --models random:qwen3-next-layout --batches 1 32 128 --time-limit 110 --out $W/layout.md
st layout_nostream 60 env TRITON_PD_STATE_STREAM=0 $B --models random:qwen3-next-layout --batches 1 32 128 --time-limit 50 --out $W/layout_nostream.md
st layout_gate0 60 env TRITON_PD_ATTN_GATE=0 $B --models random:qwen3-next-layout --batches 1 32 128 --time-limit 50 --out $W/layout_gate0.md
st seq32 50 $B --models random:qwen3-next-layout --batches 32 --profile --profile-sequence 100 --time-limit 40 --out $W/seq32.md
st qwen35 180 $B --models random:qwen3.5-9b --batches 1 32 128 --time-limit 170 --out $W/qwen35.md
st ktests 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_gpu_hybrid.py -k "decode_attention or gated_delta_step_equals"
