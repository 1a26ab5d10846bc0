# Sourced by the GPU cluster benchmarks (scripts/bench_kv_tail.sh, bench_reference_shape.sh,
# two_gpu_run.sh): starts `ferry up` with dummy weights and waits until every worker registered.
#   up_cluster LOG PREFILL_WORKERS [extra ferry up flags...]   → sets CLUSTER_PID
# Uses FERRY and MODEL from the caller; the router's public gRPC port is 18051, HTTP 18080.
# Environment: DECODE_WORKERS (default 1); UP_DEVICE, the device and model flags (default
# `--device cuda --gpu-mode fast --load-format dummy --model $MODEL`; `--device cpu` runs the
# embedded model, for a dry run of a script on a machine without a GPU); UP_FLAGS, more flags
# for every cluster (e.g. `--prefill-devices cuda:0 --decode-devices cuda:1`).
up_cluster() {
  local log=$1 prefill=$2
  shift 2
  local decode=${DECODE_WORKERS:-1}
  local device=${UP_DEVICE:-"--device cuda --gpu-mode fast --load-format dummy --model $MODEL"}
  # shellcheck disable=SC2086  # the flag lists are word-split on purpose
  "$FERRY" up $device ${UP_FLAGS:-} \
    --prefill-workers "$prefill" --decode-workers "$decode" \
    --http-addr 127.0.0.1:18080 --grpc-addr 127.0.0.1:18051 "$@" >"$log" 2>&1 &
  CLUSTER_PID=$!
  trap 'kill "$CLUSTER_PID" 2>/dev/null || true' EXIT
  local plain ready i
  for _ in $(seq 600); do
    plain=$(sed 's/\x1b\[[0-9;]*m//g' "$log")
    ready=0
    grep -q "ferry is up" <<<"$plain" && ready=1
    for ((i = 0; i < decode; i++)); do
      grep -q "registered worker=decode-$i" <<<"$plain" || ready=0
    done
    for ((i = 0; i < prefill; i++)); do
      grep -q "registered worker=prefill-$i" <<<"$plain" || ready=0
    done
    [ "$ready" = 1 ] && return 0
    if ! kill -0 "$CLUSTER_PID" 2>/dev/null; then cat "$log"; return 1; fi
    sleep 0.5
  done
  echo "the cluster did not come up:"; cat "$log"; return 1
}
