#!/usr/bin/env bash
# Runs on the GPU machine (docs/gpu.md): a speculating engine's rounds on the DSpark lease pair's
# shape with seeded random weights (models/dummy/dspark-h200 + its drafter; nothing to train:
# drafts are almost never accepted, so the speed-up means nothing, but every round verifies a
# whole block and its phases are real), under A/B switches of the round's host path. Same
# binary, arms interleaved ROUNDS times (default 2), each arm one `ferry bench-engine
# --speculative --verify-len fixed:8` at its levels:
#   ARMS (default: session 37's two switches against the default)
#     "default@1 FERRY_VERIFY_ARGMAX=0@1 default@16,64 FERRY_WHOLE_BLOCK_TAIL=0@16,64"
#   an arm is `default` or comma-joined VAR=value settings (scripts/arms.sh), then @levels.
# Per arm and level: the plain step, the round and its phases (plan / launch / sample / commit),
# and the share of rounds replayed from a graph. Table on stdout; JSON per run under $OUT
# (else ./gpu-logs), and $OUT/round_ab.json with every row.
#   ROUNDS=2 OUT=... bash scripts/bench_round_ab.sh    (TEMPERATURE=0.7: sampled requests, unseeded)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-logs}"
mkdir -p "$out"
arms="${ARMS:-default@1 FERRY_VERIFY_ARGMAX=0@1 default@16,64 FERRY_WHOLE_BLOCK_TAIL=0@16,64}"
rounds="${ROUNDS:-2}"
# shellcheck disable=SC1091
source scripts/arms.sh
# shellcheck disable=SC1091
source scripts/gpu_env.sh >/dev/null
ferry=${FERRY:-./device-bin/ferry}
echo "| arm | run | c | plain step ms | round ms | plan / launch / sample / commit ms | rounds graphed |"
echo "|---|---|---|---|---|---|---|"
for run in $(seq "$rounds"); do
  for spec in $arms; do
    arm=${spec%%@*} levels=${spec#*@}
    [ "$levels" = "$spec" ] && levels=1
    name="round_$(tag "$arm")_c$(tag "$levels")_$run"
    # shellcheck disable=SC2046
    env $(settings "$arm") timeout "${RUN_TIMEOUT:-150}" "$ferry" bench-engine --speculative \
      --load-format dummy --model models/dummy/dspark-h200 \
      --drafter models/dummy/dspark-h200-drafter --device "${DEVICE:-cuda}" --gpu-mode fast \
      --batch "$levels" --prompt-len "${PROMPT_LEN:-1024}" --decode-steps "${DECODE_STEPS:-256}" \
      --waves "${WAVES:-2}" --temperature "${TEMPERATURE:-0}" --verify-len fixed:8 --json "$out/$name.json" >"$out/$name.log" 2>&1
    python3 - "$out/$name.json" "$arm" "$run" <<'PY' || echo "| $arm | $run | $levels | (no result) | | | |"
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    e = r["engine_steps"]; p = e["plain"]["decode"]; q = e["spec"]["spec_round"]
    ph = " / ".join(f"{q[k]:.3f}" for k in ("plan_ms", "launch_ms", "sample_ms", "commit_ms"))
    print(f"| {sys.argv[2]} | {sys.argv[3]} | {r['concurrency']} | {p['ms']:.3f} | {q['ms']:.3f} | {ph} "
          f"| {q['graphed_steps']} of {q['steps']} |")
PY
  done
done
python3 - "$out" <<'PY'
import glob, json, os, sys
rows = []
for f in sorted(glob.glob(os.path.join(sys.argv[1], "round_*.json"))):
    for r in json.load(open(f))["rows"]:
        rows.append({"file": os.path.basename(f), **r})
json.dump({"benchmark": "scripts/bench_round_ab.sh", "rows": rows},
          open(os.path.join(sys.argv[1], "round_ab.json"), "w"), indent=1)
PY
