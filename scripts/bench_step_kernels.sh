#!/usr/bin/env bash
# Runs on the GPU machine (docs/gpu.md): where a graph-replayed decode step of the
# DeepSeek-V2-Lite-shaped model goes, kernel by kernel (issue 13). A first run lists the kernels
# the step launches (`FERRY_PROFILE_TWICE=none` names each on its first lookup); then each is
# queued twice in a run of its own (`FERRY_PROFILE_TWICE=<name>`), and the step's growth over
# the base runs is that kernel's cost inside the graph, its neighbours' overlap included.
# Results are wrong under the switch: the times are what counts.
#   BATCH=1 OUT=... bash scripts/bench_step_kernels.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-logs}"
mkdir -p "$out"
# shellcheck disable=SC1091
source scripts/gpu_env.sh >/dev/null
batch=${BATCH:-1}
# step LOG [VAR=VALUE ...]: one bench_gpu run into LOG; prints its graph ms / step.
step() {
  local log=$1
  shift
  env "$@" FERRY_BENCH_SKIP_KERNELS=1 FERRY_BENCH_PREFILL= FERRY_BENCH_BATCH="$batch" \
    timeout "${RUN_TIMEOUT:-120}" ./device-bin/bench_gpu 1024 64 >"$log" 2>&1
  grep -E "^\| $batch \|" "$log" | tail -1 | awk -F'|' '{gsub(/ /, "", $4); print $4}'
}
list="$out/kernels_b$batch.log"
b1=$(step "$list" FERRY_PROFILE_TWICE=none)
b2=$(step "$out/base2_b$batch.log")
base=$(python3 -c "print(min($b1, $b2))")
echo "batch $batch: base graph ms / step $b1, $b2"
echo
echo "| kernel | graph ms / step, launched twice | + ms / step |"
echo "|---|---|---|"
for k in $(sed -n 's/^FERRY_PROFILE_TWICE: kernel \([A-Za-z0-9_]*\).*/\1/p' "$list" | sort -u); do
  ms=$(step "$out/twice_${k}_b$batch.log" FERRY_PROFILE_TWICE="$k")
  python3 -c "print(f'| \`$k\` | $ms | {($ms) - $base:+.3f} |')" 2>/dev/null || echo "| \`$k\` | $ms | |"
done
