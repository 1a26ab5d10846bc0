#!/usr/bin/env bash
# Runs on the GPU machine: the first call for branch session47-queued-drafts (session 48 ran
# it, then merged the branch: BENCHMARKS.md, session 48); a template for measuring a branch.
# The branch's GPU tests, then its speculative rounds against main's on the DSpark shape at
# c = 64 / 128 (scripts/bench_binary_ab.sh, rounds workload): with staged writes
# (FERRY_ASYNC_WRITES=1) on both, then queued drafts off against on in the branch's binary
# (staged writes on), then the two binaries with default writes. Each step's log and JSON go
# under $OUT (else ./gpu-logs); the steps come in order of value, so a call cut short keeps the
# first ones.
#   device-bin/: ferry (the branch), ferry-main (main), engine_device, backend, cuda_parity,
#   SRC_ROOT (scripts/gpu_bins.sh); or all of them packed in device-bin/pack.tar.xz
#   (`tar cf - … | xz -9`: the two ferry binaries compress to one's size together).
#   OUT=$OUT bash scripts/bench_queued_drafts.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-logs}"
mkdir -p "$out"
if [ -f device-bin/pack.tar.xz ]; then
  tar xJf device-bin/pack.tar.xz -C device-bin || exit 1
fi
nvidia-smi --query-gpu=name,memory.total --format=csv
first="narrower_uniform whole_generations queued_drafts speculative_greedy"
GPU_TEST_TIMEOUT=240 GPU_TEST_FILTER="$first" OUT="$out/tests" bash scripts/gpu_tests.sh engine_device
export WORKLOADS=rounds ROUND_LEVELS=${ROUND_LEVELS:-64,128} FERRY_GRAPH_MAX_BATCH=1152 \
  ROUNDS=${ROUNDS:-2} RUN_TIMEOUT=100
ab() {  # name, then VAR=value settings for both binaries
  local name=$1
  shift
  env "$@" OUT="$out/$name" timeout 200 bash scripts/bench_binary_ab.sh >"$out/$name.md" 2>&1
  sed -n '/^median ms/,$p' "$out/$name.md"
}
ab staged FERRY_ASYNC_WRITES=1 FERRY_A=device-bin/ferry-main FERRY_B=device-bin/ferry
ab queued FERRY_ASYNC_WRITES=1 FERRY_A=device-bin/ferry FERRY_B=device-bin/ferry \
  FERRY_A_ENV=FERRY_QUEUED_DRAFTS=0
ab default FERRY_A=device-bin/ferry-main FERRY_B=device-bin/ferry
# The rest: every test but the four that ran first.
GPU_TEST_TIMEOUT=400 GPU_TEST_FILTER="$(printf -- '--skip %s ' $first)" OUT="$out/tests_rest" \
  bash scripts/gpu_tests.sh backend cuda_parity engine_device
