#!/usr/bin/env bash
# The multi-server measurements on a GPU host (issue #18), each bounded in wall clock, results under OUT:
#   bash perf/multiserver_gpu.sh OUT handoff|seed|replay "PREFILL_GPU DECODE_GPU"
# handoff: the network transport's hand-off against the backend's bare send/recv (NCCL across two GPUs; gloo,
#          and an NCCL attempt, when both sides share one GPU);
# seed:    the seed scenario (4 x 4000, 3 x 5500 tokens in an 8192-token decode pool) with prefill, decode and
#          master in servers of their own, KV over the network transport;
# replay:  pause vs restart on a slice of the Mooncake trace, same layout (traces from data_traces/, a copy of
#          ../shared/data/traces, which does not travel).
# Every step runs through the offline bundle (`triton-pd bundle .bundle`).
set -uo pipefail
OUT=${1:?OUT folder}
WHAT=${2:?handoff, seed or replay}
read -r PGPU DGPU <<<"${3:-0 0}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
RUN="bash .bundle/bootstrap.sh"
mkdir -p "$OUT"
step() {  # name, wall limit (s), command...
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T), limit ${limit}s)"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "   exit $?"
  tail -n 15 "$OUT/$name.log"
}
SPLIT=(--layout split --serve-args "--device gpu --prefill-gpus $PGPU --decode-gpus $DGPU")
case "$WHAT" in
  handoff)
    if [ "$PGPU" != "$DGPU" ]; then
      step handoff_nccl 240 $RUN python3 -m perf.handoff_net --backend nccl --src-device "cuda:$PGPU" \
        --dst-device "cuda:$DGPU" --out "$OUT/handoff_nccl.md" --limit 220
    else
      step handoff_gloo 200 $RUN python3 -m perf.handoff_net --backend gloo --src-device "cuda:$PGPU" \
        --dst-device "cuda:$DGPU" --out "$OUT/handoff_gloo.md" --limit 180
      step handoff_nccl_one_gpu 60 $RUN python3 -m perf.handoff_net --backend nccl --src-device "cuda:$PGPU" \
        --dst-device "cuda:$DGPU" --tokens 512 --reps 1 --out "$OUT/handoff_nccl_one_gpu.md" --limit 50
    fi ;;
  seed)
    step seed 560 $RUN python3 perf/seed_stalls.py --out "$OUT/seed" --policies rotate --phase-limit 110 "${SPLIT[@]}" ;;
  replay)
    step replay 560 $RUN python3 -m backends.cli bench compare --model random:llama3.1-8b --time-scale 0.5 \
      --max-users 256 --timeout 200 --stuck-after 60 --no-plots --modes pause restart --run-limit 120 \
      --out "$OUT/replay" --trace data_traces/mooncake/synthetic_trace.jsonl --duration 60 --input-scale 0.1 \
      --layout split --serve-args "--device gpu --prefill-gpus $PGPU --decode-gpus $DGPU --kv-tokens 12288 \
      --prefill-kv-tokens 65536 --max-batch 128 --max-prefill-tokens 8192 --chunk-size 2048" ;;
  *) echo "unknown step $WHAT" >&2; exit 2 ;;
esac
