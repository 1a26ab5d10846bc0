#!/usr/bin/env bash
# The reference serving shape on one GPU (issue 13's cluster benchmark): `ferry up` on a
# dummy-weights model (default: DeepSeek-V2-Lite's config), `ferry bench` at
# PROMPT-token prompts / OUTPUT new tokens over the concurrency levels given, once
# disaggregated (1 prefill + 1 decode worker sharing the GPU) and once aggregated (one decode
# worker that prefills itself). Prints ferry bench's Markdown tables.
#   scripts/bench_reference_shape.sh 1,4,16,64
# Environment: FERRY (default ./device-bin/ferry), MODEL, PROMPT (1024), OUTPUT (400),
# REQUESTS (per level, default 16), TRANSPORT (tcp), MODES ("disaggregated aggregated"),
# MAX_RUNNING (sequences a worker decodes at once, default 64), VOCAB (prompt token ids are drawn
# below it, default 100000; a CPU dry run with UP_DEVICE="--device cpu" takes 2000).
set -uo pipefail
cd "$(dirname "$0")/.."
FERRY=${FERRY:-./device-bin/ferry}
MODEL=${MODEL:-models/dummy/deepseek-v2-lite}
LEVELS=${1:-1,4,16}
# shellcheck source=scripts/gpu_cluster.sh
source scripts/gpu_cluster.sh
for mode in ${MODES:-disaggregated aggregated}; do
  prefill=1
  [ "$mode" = aggregated ] && prefill=0
  log=$(mktemp)
  up_cluster "$log" "$prefill" --transport "${TRANSPORT:-tcp}" --kv-blocks 4096 \
    --max-running "${MAX_RUNNING:-64}" || exit 1
  pid=$CLUSTER_PID
  echo "### $mode ($MODEL, dummy weights, fast mode; ${PROMPT:-1024} in / ${OUTPUT:-400} out)"
  "$FERRY" bench --grpc-addr 127.0.0.1:18051 --concurrency "$LEVELS" \
    --requests-per-level "${REQUESTS:-16}" --prompt-tokens "${PROMPT:-1024}" \
    --output-tokens "${OUTPUT:-400}" --vocab "${VOCAB:-100000}"
  sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -E "WARN|ERROR" | grep -v tokenizer | tail -5
  kill "$pid"; wait "$pid" 2>/dev/null || true
  rm -f "$log"
done
