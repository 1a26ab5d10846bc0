#!/usr/bin/env bash
# Runs on the GPU machine (docs/gpu.md): issue 13's A/B runs of decode-path switches, same
# binaries, arms interleaved ROUNDS times (default 3). Each word of ARMS is one arm: `default`
# (no switch set) or comma-joined VAR=value settings, e.g.
#   ARMS="default FERRY_L2_WARM=gate_up FERRY_L2_WARM=shared FERRY_SHARED_BESIDE=graphs,FERRY_L2_WARM=shared"
# Each arm runs
#   1. the graph-replayed (and eager) decode step of the DeepSeek-V2-Lite-shaped model at 1k
#      context (`bench_gpu 1024 64`; BATCH, default 1, e.g. 1,32);
#   2. unless ROUNDS_ENGINE=0, the serving engine on the DSpark lease target's shape with dummy
#      weights (`ferry bench-engine --speculative`, c = 1, fixed:8): its plain step and its round.
# ROUNDS_GPU=0 skips step 1. Logs and the runs' JSON under $OUT (else ./gpu-logs). With
# FERRY_GRAPH_EDGES=1 set, it also prints each arm's captured graphs' node, edge and
# programmatic-edge counts.
#   ARMS=... ROUNDS=3 BATCH=1 OUT=... bash scripts/bench_decode_arms.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-logs}"
mkdir -p "$out"
# shellcheck disable=SC1091
source scripts/gpu_env.sh >/dev/null
arms="${ARMS:-default}"
rounds="${ROUNDS:-3}"
batch="${BATCH:-1}"
# settings (an arm's VAR=value lines) and tag (its file-name tag).
# shellcheck disable=SC1091
source scripts/arms.sh
if [ "${ROUNDS_GPU:-1}" = 0 ]; then
  rounds_gpu=0
else
  rounds_gpu="$rounds"
  echo "| arm | round | batch | eager ms/step | graph ms/step | tok/s | % of copy |"
  echo "|---|---|---|---|---|---|---|"
fi
for round in $(seq "$rounds_gpu"); do
  for arm in $arms; do
    log="$out/bench_gpu_$(tag "$arm")_$round.log"
    # shellcheck disable=SC2046
    env $(settings "$arm") FERRY_BENCH_SKIP_KERNELS=1 FERRY_BENCH_PREFILL= \
      FERRY_BENCH_BATCH="$batch" timeout "${RUN_TIMEOUT:-120}" ./device-bin/bench_gpu 1024 64 >"$log" 2>&1
    grep -E '^\| [0-9]+ \|' "$log" | tail -n "$(echo "$batch" | tr ',' '\n' | wc -l)" |
      awk -F'|' -v a="$arm" -v r="$round" '{print "| " a " | " r " |" $2 "|" $3 "|" $4 "|" $5 "|" $8 "|"}' |
      grep . || echo "| $arm | $round | (no result: $(tail -n 1 "$log")) | | | | |"
  done
done
# With FERRY_GRAPH_EDGES=1 in the environment, what each arm's captured graphs held.
if [ "${FERRY_GRAPH_EDGES:-}" = 1 ] && [ "$rounds_gpu" != 0 ]; then
  echo
  for arm in $arms; do
    echo "$arm: $(grep -h '^FERRY_GRAPH_EDGES' "$out/bench_gpu_$(tag "$arm")_1.log" | sort | uniq -c | tr -s ' ' | paste -sd ';' -)"
  done
fi
[ "${ROUNDS_ENGINE:-1}" = 0 ] && exit 0
echo
echo "| arm | plain step ms | round ms (plan / launch / sample / commit) |"
echo "|---|---|---|"
for round in $(seq "$rounds"); do
  for arm in $arms; do
    json="$out/rounds_$(tag "$arm")_$round.json"
    # shellcheck disable=SC2046
    env $(settings "$arm") timeout "${RUN_TIMEOUT:-120}" ./device-bin/ferry bench-engine --speculative \
      --load-format dummy --model models/dummy/dspark-h200 --drafter models/dummy/dspark-h200-drafter \
      --device cuda --gpu-mode fast --batch 1 --prompt-len 1024 --decode-steps 256 --verify-len fixed:8 \
      --repeat 1 --json "$json" >"$out/rounds_$(tag "$arm")_$round.log" 2>&1
    python3 - "$json" "$arm" <<'PY' || echo "| $arm | (no result) | |"
import json, sys
r = json.load(open(sys.argv[1]))["rows"][0]["engine_steps"]
p, q = r["plain"]["decode"], r["spec"]["spec_round"]
ph = " / ".join(f"{q[k]:.3f}" for k in ("plan_ms", "launch_ms", "sample_ms", "commit_ms"))
print(f"| {sys.argv[2]} | {p['ms']:.3f} | {q['ms']:.3f} ({ph}) |")
PY
  done
done
