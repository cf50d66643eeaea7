#!/usr/bin/env bash
# Trace replays of the decode-liveness work (pause mode, 2x the traces' rate, random Llama-3.1-8B shape), bounded in
# wall clock, each result packed into one archive under OUT. Run on the GPU host from the project root:
#   bash perf/liveness_replays.sh OUT "PREFILL_GPU DECODE_GPU" [MODES]
# e.g. bash perf/liveness_replays.sh /tmp/out "1 0" "pause restart"   (prefill on GPU 1, decode on GPU 0)
# Traces are read from data_traces/ (a copy of ../shared/data/traces; ../shared does not travel to the GPU host).
set -uo pipefail
OUT=${1:?OUT folder}
read -r PGPU DGPU <<<"${2:-0 0}"
MODES=${3:-pause}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SA="--device gpu --prefill-gpus $PGPU --decode-gpus $DGPU --kv-tokens 12288 --prefill-kv-tokens 65536 --max-batch 128 --max-prefill-tokens 8192 --chunk-size 2048"
COMMON=(--model random:llama3.1-8b --time-scale 0.5 --max-users 256 --timeout 200 --stuck-after 60 --no-plots --modes $MODES)
mkdir -p "$OUT"
run() {  # name, wall limit for the whole compare (s), then bench arguments
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T))"
  timeout -k 10 "$limit" bash .bundle/bootstrap.sh python3 -m backends.cli bench compare "${COMMON[@]}" \
    --out "/tmp/replays/$name" --serve-args "$SA" "$@" 2>&1 | grep -v "^\[replay" | tail -30
  echo "   exit ${PIPESTATUS[0]}"
  tar -czf "$OUT/$name.tgz" -C /tmp/replays "$name" 2>/dev/null
}
run mooncake "${MOONCAKE_LIMIT:-300}" --trace data_traces/mooncake/synthetic_trace.jsonl --duration 60 --input-scale 0.1 --run-limit 150
run azure "${AZURE_LIMIT:-240}" --trace data_traces/azure_code/AzureLLMInferenceTrace_code.csv --duration 120 --conversations 16 --run-limit 150
