#!/usr/bin/env bash
# bash perf/results/attn_kvp_h100/commands.sh OUT, from the project root at commit 2fc0f51 (kv_per_program, taken
# out after it) on the GPU host (its python3, no bundle); the alone timing is attn_alone.py beside this file
set -uo pipefail
OUT=$1; W=$OUT/files; mkdir -p $W
cp perf/tune_cache/*.json $W/ && chmod u+w $W/*.json
export TRITON_PD_TUNE_CACHE=$W/linear-tune.json PYTHONUNBUFFERED=1
trap 'rm -f $W/*.lock; tar -czf $OUT/files.tgz -C $W .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== kernel tests $(date +%T)"
timeout -k 5 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py -k decode_attention > $W/kernel_tests.txt 2>&1; echo "   exit $?"; tail -2 $W/kernel_tests.txt
echo "== alone b32 $(date +%T)"; timeout -k 5 80 python3 perf/results/attn_kvp_h100/attn_alone.py 32 2>&1 | grep -v -i warn | tee $W/alone32.txt
S="python3 -m perf.instep_sweep --what attn"
run() { local name=$1 lim=$2; shift 2; echo "== $name $(date +%T)"; timeout -k 5 $lim $S --time-limit $((lim-8)) "$@" --out $W/$name.md > $W/$name.log 2>&1; echo "   exit $?"; }
run layout32_kvp 90 --attn-splits 8 16 --attn-tiles 32,4,2 16,4,2,2 16,4,3,2
run qwen32_kvp 100 --model random:qwen3.5-9b --attn-splits 4 8 16 --attn-tiles 32,4,2 16,4,2,4 16,4,2,2
for f in $W/*.md; do echo "## $f"; grep "^|" $f | grep -v "^|---" | cut -c1-150; done
