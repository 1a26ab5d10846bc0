#!/usr/bin/env bash
# Runs on the GPU machine (docs/gpu.md): projections of 2–16 rows on the tensor-core skinny GEMM
# (`gemv_mma_bf16`, the default since session 36) against the rule before it
# (`FERRY_GEMV_MMA=0`: the GEMV up to 8 rows, cast + cuBLAS above). Same binaries, arms
# interleaved ROUNDS times (default 2). Each arm:
#   1. unless VERIFY=0, the verify forward of k + 1 rows against a one-row decode step (both
#      eager), batch 1, on the random DeepSeek-V2-Lite-shaped model and on the DSpark lease
#      target's shape (`ferry bench-engine --verify-cost --load-format dummy`; VERIFY_K, default
#      1,3,7,8,15: 2 to 16 rows);
#   2. scripts/bench_decode_arms.sh at BATCH (default 1,2,4,8,16: graph-replayed decode steps
#      of the V2-Lite shape) and the DSpark-shape speculative round (c = 1, fixed:8: a 9-row
#      verify forward replayed from a graph).
# Tables on stdout; JSON and logs under $OUT (else ./gpu-logs).
#   ROUNDS=2 OUT=... bash scripts/bench_gemv_mma.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-logs}"
mkdir -p "$out"
arms="${ARMS:-default FERRY_GEMV_MMA=0}"
rounds="${ROUNDS:-2}"
ks="${VERIFY_K:-1,3,7,8,15}"
# shellcheck disable=SC1091
source scripts/arms.sh
if [ "${VERIFY:-1}" != 0 ]; then
  echo "| arm | round | shape | decode step ms | verify / step at k = $ks |"
  echo "|---|---|---|---|---|"
  for round in $(seq "$rounds"); do
    for arm in $arms; do
      for shape in deepseek-v2-lite:v2-lite-drafter dspark-h200:dspark-h200-drafter; do
        model=${shape%%:*}
        name="verify_${model}_$(tag "$arm")_$round"
        # shellcheck disable=SC2046
        env $(settings "$arm") timeout "${RUN_TIMEOUT:-150}" ./device-bin/ferry bench-engine \
          --verify-cost --device cuda --gpu-mode fast --load-format dummy \
          --model "models/dummy/$model" --drafter-config "models/dummy/${shape#*:}/config.json" \
          --batch 1 --prompt-len 1024 --verify-k "$ks" --json "$out/$name.json" >"$out/$name.log" 2>&1
        python3 - "$out/$name.json" "$arm" "$round" "$model" <<'PY' || echo "| $arm | $round | $model | (no result) | |"
import json, sys
rows = sorted((x for x in json.load(open(sys.argv[1]))["rows"] if x["batch"] == 1), key=lambda x: x["k"])
ratios = ", ".join(f"{x['verify_over_step']:.2f}" for x in rows)
print(f"| {sys.argv[2]} | {sys.argv[3]} | {sys.argv[4]} | {rows[0]['decode_step_ms']:.3f} | {ratios} |")
PY
      done
    done
  done
  echo
fi
ROUNDS="$rounds" BATCH="${BATCH:-1,2,4,8,16}" ARMS="$arms" OUT="$out" bash scripts/bench_decode_arms.sh
