#!/usr/bin/env bash
# run 1: attention gate fused; cold tune; A/B with TRITON_PD_ATTN_GATE=0; profile sequence at b32
set -uo pipefail
OUT=$1; W=$OUT/files; mkdir -p $W
cp perf/tune_cache/*.json $W/; chmod u+w $W/*.json
export PYTHONUNBUFFERED=1 TRITON_PD_TUNE_CACHE=$W/linear-tune.json
trap 'tar -czf $OUT/files.tgz -C $W .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
st() { local n=$1 l=$2; shift 2; echo "== $n $(date +%T)"; timeout -k 5 $l "$@" > $W/$n.log 2>&1; echo "   exit $?"; grep -v "graph of [0-9]*, " $W/$n.log | tail -n 25; }
st layout 210 python3 -m perf.hybrid_bench --models random:qwen3-next-layout --batches 1 32 128 --prefill 0 --reps 20 --eager-batches --profile --time-limit 200 --out $W/layout.md
st layout_gate0 110 env TRITON_PD_ATTN_GATE=0 python3 -m perf.hybrid_bench --models random:qwen3-next-layout --batches 1 32 128 --prefill 0 --reps 20 --eager-batches --time-limit 100 --out $W/layout_gate0.md
st layout_again 70 python3 -m perf.hybrid_bench --models random:qwen3-next-layout --batches 1 32 128 --prefill 0 --reps 20 --eager-batches --time-limit 60 --out $W/layout_again.md
st seq32 60 python3 -m perf.hybrid_bench --models random:qwen3-next-layout --batches 32 --prefill 0 --reps 20 --eager-batches --profile --profile-sequence 100 --time-limit 50 --out $W/seq32.md
st ktests 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_gpu_hybrid.py -k "decode_attention or graph_decode_steps or fused_prologues or keeps_cublas"
