#!/usr/bin/env bash
# Runs on the GPU machine (docs/gpu.md): `bench_gpu`'s batched decode and prefill tables on the
# DeepSeek-V2-Lite shape once per grouped-MoE kernel arm (`FERRY_MOE_MMA`), the arms interleaved
# ROUNDS times in one call so drift between them shows. One log per run under $OUT (else
# ./gpu-logs), then every run's table rows, arm by arm.
#   ARMS="auto pipe" ROUNDS=2 BATCH=32,64,128,256 PREFILL=1024,8192 scripts/bench_moe_arms.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-logs}"
mkdir -p "$out"
# shellcheck disable=SC1091
source scripts/gpu_env.sh >/dev/null
arms="${ARMS:-auto pipe}"
for round in $(seq "${ROUNDS:-2}"); do
  for arm in $arms; do
    log="$out/bench_moe_${arm}_${round}.log"
    FERRY_MOE_MMA="$arm" FERRY_BENCH_SKIP_KERNELS=1 FERRY_BENCH_BATCH="${BATCH:-32,64,128,256}" \
      FERRY_BENCH_PREFILL="${PREFILL:-1024,8192}" \
      timeout "${BENCH_TIMEOUT:-240}" ./device-bin/bench_gpu 1024 64 >"$log" 2>&1
    echo "$arm round $round: rc=$?"
  done
done
for arm in $arms; do
  echo "== FERRY_MOE_MMA=$arm"
  grep -h '^|' "$out"/bench_moe_"${arm}"_*.log
done
