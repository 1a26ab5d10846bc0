#!/usr/bin/env bash
# The KV transfer's tail on one GPU (issue 14's overlap benchmark): `ferry up` with one prefill
# and one decode worker on a dummy-weights model (default: DeepSeek-V2-Lite's config),
# KV over each transport given (ucx: cuda_ipc device to device, with a CUDA-enabled UCX loaded
# through FERRY_UCX_LIB; tcp: through host memory); `ferry bench` sends TOKENS-token prompts one
# at a time; the prefill worker's metrics give, per request, the tail (the end of the prefill
# forward → the transfer's flush acknowledged: what the decode worker waits for beyond the
# compute) and the whole prefill call. Prints one line per transport and, with JSON=path,
# writes them there.
#   scripts/bench_kv_tail.sh ucx tcp
# Environment: FERRY (binary, default ./device-bin/ferry), MODEL, TOKENS (8192), REQUESTS (6).
set -euo pipefail
cd "$(dirname "$0")/.."
FERRY=${FERRY:-./device-bin/ferry}
MODEL=${MODEL:-models/dummy/deepseek-v2-lite}
TOKENS=${TOKENS:-8192}
REQUESTS=${REQUESTS:-6}
# shellcheck source=scripts/gpu_cluster.sh
source scripts/gpu_cluster.sh
rows=()
for transport in "$@"; do
  log=$(mktemp)
  up_cluster "$log" 1 --transport "$transport" --kv-blocks 1024 || exit 1
  pid=$CLUSTER_PID
  metrics=$(grep -oE "prefill-0 +http://[0-9.:]+/metrics" "$log" | awk '{print $2}')
  if [ -z "$metrics" ]; then echo "no prefill metrics address in:"; cat "$log"; exit 1; fi
  if ! "$FERRY" bench --grpc-addr 127.0.0.1:18051 --concurrency 1 \
    --requests-per-level "$REQUESTS" --prompt-tokens "$TOKENS" --output-tokens 8 --vocab 100000; then
    echo "$transport: ferry bench failed; the cluster's log:"
    grep -iE "warn|error|fail|panick" "$log" | tail -20
    if [ -n "${LOGS:-}" ]; then cp "$log" "$LOGS/up-$transport.log"; fi
    kill "$pid"; wait "$pid" 2>/dev/null || true
    continue
  fi
  m=$(curl -s "$metrics")
  # Series carry the worker's labels: `name{worker_id="…"} value`.
  get() { echo "$m" | awk -v k="$1" 'index($1, k) == 1 && (length($1) == length(k) || substr($1, length(k) + 1, 1) == "{") {print $2}'; }
  tail_sum=$(get ferry_kv_transfer_tail_seconds_sum); n=$(get ferry_kv_transfer_tail_seconds_count)
  if [ "${n:-0}" = "0" ]; then
    echo "$transport: no transfer completed on the prefill worker; its log:"
    grep -iE "warn|error|fail" "$log" | tail -20
    kill "$pid"; wait "$pid" 2>/dev/null || true
    continue
  fi
  dur_sum=$(get ferry_prefill_duration_seconds_sum)
  line=$(python3 -c "
t, d, n = $tail_sum, $dur_sum, $n
print(f'{\"$transport\"}: {n:.0f} prefills of $TOKENS tokens, tail {1e3*t/n:.2f} ms, prefill call {1e3*d/n:.1f} ms, tail / compute {100*t/(d-t):.2f} %')")
  echo "$line"
  rows+=("{\"transport\": \"$transport\", \"tokens\": $TOKENS, \"requests\": $n, \"tail_s_mean\": $(python3 -c "print($tail_sum/$n)"), \"prefill_call_s_mean\": $(python3 -c "print($dur_sum/$n)")}")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  if [ -n "${LOGS:-}" ]; then cp "$log" "$LOGS/up-$transport.log"; fi
  rm -f "$log"
done
if [ -n "${JSON:-}" ]; then
  (IFS=,; echo "{\"benchmark\": \"KV transfer tail on one GPU: ferry up (1 prefill + 1 decode, $MODEL, dummy weights, fast mode), ferry bench at $TOKENS prompt tokens, concurrency 1\", \"results\": [${rows[*]}]}") >"$JSON"
fi
