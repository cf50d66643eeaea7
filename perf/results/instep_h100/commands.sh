#!/usr/bin/env bash
# bash perf/results/instep_h100/commands.sh OUT, from the project root on the GPU host (its python3, no bundle)
set -uo pipefail
OUT=$1; W=$OUT/files; mkdir -p $W
cp perf/tune_cache/*.json $W/ && chmod u+w $W/*.json
export TRITON_PD_TUNE_CACHE=$W/linear-tune.json PYTHONUNBUFFERED=1
trap 'rm -f $W/*.lock; tar -czf $OUT/files.tgz -C $W .' EXIT
S="python3 -m perf.instep_sweep --time-limit 100"
for what in whatif gate_up in_proj attn; do
  echo "== layout $what $(date +%T)"; timeout -k 5 110 $S --what $what --out $W/layout_$what.md > $W/layout_$what.log 2>&1; echo "   exit $?"
done
echo "== qwen3.5-9b whatif $(date +%T)"
timeout -k 5 110 $S --model random:qwen3.5-9b --what whatif --out $W/qwen35_whatif.md > $W/qwen35_whatif.log 2>&1; echo "   exit $?"
echo "== layout batch 128 attn $(date +%T)"
timeout -k 5 110 $S --batch 128 --what attn --attn-splits 1 2 4 --out $W/layout128_attn.md > $W/layout128_attn.log 2>&1; echo "   exit $?"
tail -n 30 $W/*.md | grep -v "^$"
