#!/usr/bin/env bash
# bash perf/results/attn_splits_h100/commands.sh OUT, from the project root at ed1b87b on the GPU host (its python3, no bundle):
# the decode attention's settings at 64-127 (sequence, kv head) pairs of 256-dim heads: 4 splits and 3 stages,
# against the code before (.gpu/before = git archive c4cb91e kernels backends perf), alternating in one command
set -uo pipefail
OUT=$1; W=$OUT/files; mkdir -p $W
cp perf/tune_cache/*.json $W/ && chmod u+w $W/*.json
export TRITON_PD_TUNE_CACHE=$W/linear-tune.json PYTHONUNBUFFERED=1
trap 'rm -f $W/*.lock; tar -czf $OUT/files.tgz -C $W .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
ROOT=$PWD
B="python3 -m perf.hybrid_bench --models random:qwen3-next-layout --batches 32 --prefill 0 --reps 20 --time-limit 42"
for i in 1 2; do
  echo "== before $i $(date +%T)"; (cd .gpu/before && PYTHONPATH=. timeout -k 5 48 $B --out $W/before$i.md > $W/before$i.log 2>&1); echo "   exit $?"
  echo "== after $i $(date +%T)"; timeout -k 5 48 $B --out $W/after$i.md > $W/after$i.log 2>&1; echo "   exit $?"
done
for f in $W/*.md; do echo "## $f"; grep "^|" $f | grep -v "^|---" | cut -c1-160; done
