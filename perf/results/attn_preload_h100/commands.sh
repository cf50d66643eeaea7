#!/usr/bin/env bash
# bash perf/results/attn_preload_h100/commands.sh OUT, from the project root at commit e53f8a6 (--attn-preload is gone after it) on the GPU host (its python3, no bundle)
set -uo pipefail
OUT=$1; W=$OUT/files; mkdir -p $W
cp perf/tune_cache/*.json $W/ && chmod u+w $W/*.json
export TRITON_PD_TUNE_CACHE=$W/linear-tune.json PYTHONUNBUFFERED=1
trap 'rm -f $W/*.lock; tar -czf $OUT/files.tgz -C $W .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== kernel tests $(date +%T)"
timeout -k 5 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py -k decode_attention > $W/kernel_tests.txt 2>&1; echo "   exit $?"; tail -2 $W/kernel_tests.txt
S="python3 -m perf.instep_sweep --what attn"
run() { local name=$1 lim=$2; shift 2; echo "== $name $(date +%T)"; timeout -k 5 $lim $S --time-limit $((lim-8)) "$@" --out $W/$name.md > $W/$name.log 2>&1; echo "   exit $?"; }
run layout32_pre 125 --attn-splits 8 4 --attn-tiles 32,4,2 32,4,3 --attn-preload 0 1 2 3
run layout32_splits 105 --attn-splits 3 5 6 --attn-tiles 32,4,2 32,4,3 --attn-preload 0 2
run layout1_pre 70 --batch 1 --attn-splits 16 --attn-tiles 64,8,2 --attn-preload 0 1 2 3
run layout128_pre 80 --batch 128 --attn-splits 2 --attn-tiles 32,4,2 --attn-preload 0 1 2 3
run qwen32_pre 100 --model random:qwen3.5-9b --attn-splits 8 4 --attn-tiles 32,4,2 --attn-preload 0 2 3
for f in $W/*.md; do echo "## $f"; grep "^|" $f | grep -v "^|---" | cut -c1-150; done
