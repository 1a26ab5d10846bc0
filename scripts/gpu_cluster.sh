# Sourced by the GPU cluster benchmarks (scripts/bench_kv_tail.sh, bench_reference_shape.sh):
# starts `ferry up` on CUDA with dummy weights and waits until both kinds of worker registered.
#   up_cluster LOG PREFILL_WORKERS [extra ferry up flags...]   → sets CLUSTER_PID
# Uses FERRY and MODEL from the caller; the router's public gRPC port is 18051, HTTP 18080.
up_cluster() {
  local log=$1 prefill=$2
  shift 2
  "$FERRY" up --device cuda --gpu-mode fast --load-format dummy --model "$MODEL" \
    --prefill-workers "$prefill" --decode-workers 1 \
    --http-addr 127.0.0.1:18080 --grpc-addr 127.0.0.1:18051 "$@" >"$log" 2>&1 &
  CLUSTER_PID=$!
  trap 'kill "$CLUSTER_PID" 2>/dev/null || true' EXIT
  local plain
  for _ in $(seq 600); do
    plain=$(sed 's/\x1b\[[0-9;]*m//g' "$log")
    grep -q "ferry is up" <<<"$plain" && grep -q "registered worker=decode-0" <<<"$plain" \
      && { [ "$prefill" = 0 ] || grep -q "registered worker=prefill-0" <<<"$plain"; } && return 0
    if ! kill -0 "$CLUSTER_PID" 2>/dev/null; then cat "$log"; return 1; fi
    sleep 0.5
  done
  echo "the cluster did not come up:"; cat "$log"; return 1
}
