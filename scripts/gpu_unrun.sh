#!/usr/bin/env bash
# Runs on the GPU machine (docs/gpu.md): what sessions 33-34 wrote without a GPU, so that one
# lease checks and measures it all. Each stage fits one device call (≤ 10 min); logs and JSON go
# under $OUT/<stage> (else ./gpu-logs/<stage>). Needs device-bin/ (scripts/gpu_bins.sh) and, for
# `lanes`, devpack/ucx.tar.xz (scripts/ucx_cuda_pack.sh).
#   STAGES="check lanes" OUT=$OUT bash scripts/gpu_unrun.sh     # first call
#   STAGES="arms" OUT=$OUT bash scripts/gpu_unrun.sh            # second call
#   STAGES="rounds" OUT=$OUT bash scripts/gpu_unrun.sh          # third, with issue 15's lease
# Each bench_gpu / bench-engine run draws a 31 GB random model first (tens of seconds), so the
# arms are few: 5 arms × 2 rounds in `arms`, 2 × 2 in `rounds`; ARMS / ROUNDS override.
# Stages:
#   check  the kernel and engine tests with every opt-in switch of session 33 on (L2 warm-up,
#          fused router + routing, staged writes, the shared expert beside the router in graphs),
#          and once with defaults; one bench_gpu with FERRY_GRAPH_EDGES=1 (do replayed graphs
#          keep programmatic dependent launch?)
#   lanes  issue 14: bench_transfer_gpu with writers of 1, 2 and 4 UCX lanes, then ucx_device and
#          cluster_device with FERRY_UCX_LANES=4 (cuda_ipc puts from lane threads)
#   arms   issue 13: scripts/bench_decode_arms.sh, the decode step (batch 1 and 32) with each
#          promising switch alone against the default
#   rounds issue 15: a speculative round's phases (bench-engine, c = 1, fixed:8) with staged
#          writes (the default since session 48) against FERRY_ASYNC_WRITES=0
#   arena  issue 13 on the card the bars are stated for (the H200): the graph arena (default
#          since session 35) against FERRY_GRAPH_ARENA=0, batch 1-256 and the DSpark shape's
#          engine rounds, then the graphs' node kinds (FERRY_GRAPH_EDGES=1)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-logs}"
stages="${STAGES:-check lanes}"
# Session 33's opt-in switches, all on (the arms stage measures each alone; staged writes are
# the default since session 48).
ALL_ON="FERRY_L2_WARM=shared,o_proj,next_attn,last FERRY_ROUTER_FUSED=1 FERRY_SHARED_BESIDE=graphs"

ucx_env() {
  mkdir -p /tmp/ucx && tar xJf devpack/ucx.tar.xz -C /tmp/ucx || return 1
  export LD_LIBRARY_PATH=/tmp/ucx/lib:/tmp/ucx/lib/ucx:/tmp/ucx/libs:${LD_LIBRARY_PATH:-} \
    UCX_MODULE_DIR=/tmp/ucx/lib/ucx FERRY_UCX_LIB=/tmp/ucx/lib/libucp.so.0
}

for stage in $stages; do
  dir="$out/$stage"
  mkdir -p "$dir"
  echo "== $stage ($(date +%T))"
  case "$stage" in
    check)
      OUT="$dir/default" bash scripts/gpu_tests.sh backend cuda_parity
      # shellcheck disable=SC2086
      env $ALL_ON OUT="$dir/all_on" bash scripts/gpu_tests.sh backend engine_device gpu_parity spec_drafter
      # shellcheck disable=SC1091
      source scripts/gpu_env.sh >/dev/null
      FERRY_GRAPH_EDGES=1 FERRY_BENCH_SKIP_KERNELS=1 FERRY_BENCH_PREFILL= FERRY_BENCH_BATCH=1 \
        timeout 120 ./device-bin/bench_gpu 1024 64 >"$dir/graph_edges.log" 2>&1
      grep -h '^FERRY_GRAPH_EDGES' "$dir/graph_edges.log" | sort | uniq -c | head -20
      ;;
    lanes)
      if ! ucx_env; then
        echo "lanes: devpack/ucx.tar.xz missing (scripts/ucx_cuda_pack.sh)"
        continue
      fi
      # shellcheck disable=SC1091
      source scripts/gpu_env.sh >/dev/null
      timeout 300 ./device-bin/bench_transfer_gpu --tokens 1024,8192,32768 --run-mib 0 \
        --lanes 1,2,4 --runs 9 --json "$dir/transfer_gpu_lanes.json" 2>&1 | tee "$dir/transfer_gpu_lanes.log"
      FERRY_UCX_LANES=4 OUT="$dir" bash scripts/gpu_tests.sh ucx_device cluster_device
      ;;
    arms)
      ROUNDS="${ROUNDS:-2}" BATCH="${BATCH:-1,32}" OUT="$dir" ROUNDS_ENGINE=0 RUN_TIMEOUT=90 \
        ARMS="${ARMS:-default FERRY_SHARED_BESIDE=graphs FERRY_L2_WARM=shared,o_proj,last FERRY_L2_WARM=next_attn,last FERRY_ROUTER_FUSED=1}" \
        bash scripts/bench_decode_arms.sh | tee "$dir/arms.md"
      ;;
    rounds)
      # bench_decode_arms.sh's engine table only (ROUNDS_GPU=0 skips its bench_gpu runs).
      ROUNDS="${ROUNDS:-2}" OUT="$dir" RUN_TIMEOUT=120 ROUNDS_GPU=0 \
        ARMS="${ARMS:-default FERRY_ASYNC_WRITES=0}" \
        bash scripts/bench_decode_arms.sh | tee "$dir/rounds.md"
      ;;
    arena)
      ROUNDS="${ROUNDS:-3}" BATCH="${BATCH:-1,32,128,256}" OUT="$dir" RUN_TIMEOUT=90 \
        ARMS="${ARMS:-default FERRY_GRAPH_ARENA=0}" \
        bash scripts/bench_decode_arms.sh | tee "$dir/arena.md"
      # shellcheck disable=SC1091
      source scripts/gpu_env.sh >/dev/null
      FERRY_GRAPH_EDGES=1 FERRY_BENCH_SKIP_KERNELS=1 FERRY_BENCH_PREFILL= FERRY_BENCH_BATCH=1,32,128,256 \
        timeout 120 ./device-bin/bench_gpu 1024 64 2>&1 | grep -h '^FERRY_GRAPH_EDGES' | sort | uniq -c
      ;;
    *)
      echo "unknown stage $stage (check, lanes, arms, rounds, arena)"
      ;;
  esac
done
echo "== done ($(date +%T))"
