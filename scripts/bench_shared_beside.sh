#!/usr/bin/env bash
# Runs on the GPU machine (docs/gpu.md): issue 13's A/B of one token's shared expert beside the
# router (kernels/src/gpu/ops.rs `moe_token_beside`, `SharedBeside`) against the old launch order
# (`FERRY_SHARED_BESIDE=0`, the default), same binaries, arms interleaved ROUNDS times (default 3).
# ARMS (default "0 graphs": beside in captured graphs only) may add `1` (eager steps too):
#   1. the graph-replayed single-stream step of the DeepSeek-V2-Lite-shaped model at 1k context
#      (`bench_gpu 1024 64`, batch 1; BATCH adds batches, where nothing changes: one token only);
#   2. the same through the serving engine on the DSpark lease target's shape with dummy weights
#      (`ferry bench-engine --speculative`, c = 1, fixed:8): its plain step and its round.
# Logs and the runs' JSON under $OUT (else ./gpu-logs).
#   ROUNDS=3 BATCH=1 OUT=... bash scripts/bench_shared_beside.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-logs}"
mkdir -p "$out"
# shellcheck disable=SC1091
source scripts/gpu_env.sh >/dev/null
echo "| arm | round | batch | eager ms/step | graph ms/step | tok/s | % of copy |"
echo "|---|---|---|---|---|---|---|"
for round in $(seq "${ROUNDS:-3}"); do
  for arm in ${ARMS:-0 graphs}; do
    log="$out/bench_gpu_beside${arm}_$round.log"
    # shellcheck disable=SC2046
    env $([ "$arm" = default ] || echo "FERRY_SHARED_BESIDE=$arm") FERRY_BENCH_SKIP_KERNELS=1 FERRY_BENCH_PREFILL= \
      FERRY_BENCH_BATCH="${BATCH:-1}" timeout "${RUN_TIMEOUT:-120}" ./device-bin/bench_gpu 1024 64 >"$log" 2>&1
    grep -E '^\| [0-9]+ \|' "$log" | tail -n "$(echo "${BATCH:-1}" | tr ',' '\n' | wc -l)" |
      awk -F'|' -v a="$arm" -v r="$round" '{print "| " a " | " r " |" $2 "|" $3 "|" $4 "|" $5 "|" $8 "|"}'
  done
done
echo
echo "| arm | plain step ms | round ms (plan / launch / sample / commit) |"
echo "|---|---|---|"
for round in $(seq "${ROUNDS:-3}"); do
  for arm in ${ARMS:-0 graphs}; do
    json="$out/rounds_beside${arm}_$round.json"
    # shellcheck disable=SC2046
    env $([ "$arm" = default ] || echo "FERRY_SHARED_BESIDE=$arm") timeout "${RUN_TIMEOUT:-120}" ./device-bin/ferry bench-engine --speculative \
      --load-format dummy --model models/dummy/dspark-h200 --drafter models/dummy/dspark-h200-drafter \
      --device cuda --gpu-mode fast --batch 1 --prompt-len 1024 --decode-steps 256 --verify-len fixed:8 \
      --repeat 1 --json "$json" >"$out/rounds_beside${arm}_$round.log" 2>&1
    python3 - "$json" "$arm" <<'PY' || echo "| $arm | (no result) | |"
import json, sys
r = json.load(open(sys.argv[1]))["rows"][0]["engine_steps"]
p, q = r["plain"]["decode"], r["spec"]["spec_round"]
ph = " / ".join(f"{q[k]:.3f}" for k in ("plan_ms", "launch_ms", "sample_ms", "commit_ms"))
print(f"| {sys.argv[2]} | {p['ms']:.3f} | {q['ms']:.3f} ({ph}) |")
PY
  done
done
