#!/usr/bin/env bash
# Runs on the GPU machine (docs/gpu.md): two ferry binaries — a change and what it changes — on
# the DSpark lease pair's shape with seeded random weights (models/dummy/dspark-h200 + its
# drafter; nothing to train), interleaved ROUNDS times (default 2: A B A B), each run one
# `ferry bench-engine --speculative --verify-len fixed:4` per workload:
#   prompt   1,024-token prompts, 4 tokens each (`--decode-steps 4`, four waves) at c = 1 and 4
#            (one and four prompts a step): the eager prompt step, plain and speculating arm
#   rounds   c = 64 and 128, 128 tokens each, two waves: the plain decode step, the speculating
#            round and the steps that carry prompts beside running sequences
# Per binary, run and level: each step kind's ms (plan / launch / sample / commit), then the
# medians of B against A. Tables on stdout; $OUT (else ./gpu-logs) gets binary_ab.json with
# every row and runs.tar.xz with each run's JSON and log (the device tool brings back at most
# 8 files).
#   FERRY_A=device-bin/ferry-main FERRY_B=device-bin/ferry-branch OUT=... bash scripts/bench_binary_ab.sh
# Settings: ROUNDS (2), PROMPT_LEN (1024), MAX_BATCH_TOKENS (2048: a cluster worker's budget),
# VERIFY_LEN (fixed:4; e.g. fixed:2 for c = 256, where session 54's cluster bench ran it),
# PROMPT_LEVELS (1,4), ROUND_LEVELS (64,128), ROUND_STEPS (128), RUN_TIMEOUT (150 s a run),
# DEVICE (cuda), WORKLOADS ("prompt rounds": either alone measures that workload only),
# FERRY_A_ENV / FERRY_B_ENV (VAR=value ... for that binary's runs only: one binary against
# itself under a switch, e.g. FERRY_A=$F FERRY_B=$F FERRY_A_ENV=FERRY_QUEUED_DRAFTS=0).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-logs}"
runs="$out/runs"
mkdir -p "$runs"
: "${FERRY_A:?FERRY_A: the first ferry binary}"
: "${FERRY_B:?FERRY_B: the second ferry binary}"
rounds="${ROUNDS:-2}"
# shellcheck disable=SC1091
source scripts/gpu_env.sh >/dev/null
echo "| binary | run | workload | c | step kind | steps | ms | plan / launch / sample / commit ms |"
echo "|---|---|---|---|---|---|---|---|"
for run in $(seq "$rounds"); do
  for which in A B; do
    if [ "$which" = A ]; then ferry=$FERRY_A envs=${FERRY_A_ENV:-}; else ferry=$FERRY_B envs=${FERRY_B_ENV:-}; fi
    for workload in ${WORKLOADS:-prompt rounds}; do
      if [ "$workload" = prompt ]; then
        levels=${PROMPT_LEVELS:-1,4} steps=4 waves=4
      else
        levels=${ROUND_LEVELS:-64,128} steps=${ROUND_STEPS:-128} waves=2
      fi
      name="ab_${which}_${workload}_$run"
      # shellcheck disable=SC2086
      env $envs timeout "${RUN_TIMEOUT:-150}" "$ferry" bench-engine --speculative \
        --load-format dummy --model models/dummy/dspark-h200 \
        --drafter models/dummy/dspark-h200-drafter --device "${DEVICE:-cuda}" --gpu-mode fast \
        --batch "$levels" --prompt-len "${PROMPT_LEN:-1024}" --decode-steps "$steps" \
        --waves "$waves" --warmup-tokens 16 --verify-len "${VERIFY_LEN:-fixed:4}" \
        --max-batch-tokens "${MAX_BATCH_TOKENS:-2048}" --repeat 1 \
        --json "$runs/$name.json" >"$runs/$name.log" 2>&1
      python3 - "$runs/$name.json" "$which" "$run" "$workload" <<'PY' || echo "| $which | $run | $workload | (no result) | | | | |"
import json, sys
_, path, which, run, workload = sys.argv
for r in json.load(open(path))["rows"]:
    for arm, kinds in r["engine_steps"].items():
        for kind, k in kinds.items():
            if not k["steps"]:
                continue
            ph = " / ".join(f"{k[p]:.3f}" for p in ("plan_ms", "launch_ms", "sample_ms", "commit_ms"))
            print(f"| {which} | {run} | {workload} | {r['concurrency']} | {arm} {kind} | {k['steps']} "
                  f"| {k['ms']:.3f} | {ph} |")
PY
    done
  done
done
python3 - "$runs" "$out/binary_ab.json" "${FERRY_A_ENV:-} $FERRY_A" "${FERRY_B_ENV:-} $FERRY_B" <<'PY'
import glob, json, os, sys
rows = []
for f in sorted(glob.glob(os.path.join(sys.argv[1], "ab_*.json"))):
    for r in json.load(open(f))["rows"]:
        rows.append({"file": os.path.basename(f), **r})
json.dump({"benchmark": "scripts/bench_binary_ab.sh", "A": sys.argv[3].strip(), "B": sys.argv[4].strip(), "rows": rows},
          open(sys.argv[2], "w"), indent=1)
PY
# Medians per level and step kind, B against A (steps a run took more than twice only).
python3 - "$out/binary_ab.json" <<'PY'
import json, statistics, sys
d = json.load(open(sys.argv[1]))
acc = {}
for r in d["rows"]:
    which = r["file"].split("_")[1]
    if r["file"].split("_")[2] == "rounds":
        for arm in ("plain", "spec"):
            acc.setdefault((r["concurrency"], f"{arm} tok/s"), {}).setdefault(which, []).append(r[f"{arm}_tok_s"])
    for arm, kinds in r["engine_steps"].items():
        for kind, k in kinds.items():
            if k["steps"] and k["steps"] > 2:
                acc.setdefault((r["concurrency"], f"{arm} {kind}"), {}).setdefault(which, []).append(k["ms"])
print(f"\nmedians (ms a step; tok/s for the rounds workload), A = {d['A']}, B = {d['B']}")
print("| c | step kind | A | B | B vs A |")
print("|---|---|---|---|---|")
for (c, kind), v in sorted(acc.items()):
    a, b = (statistics.median(v[w]) if v.get(w) else None for w in ("A", "B"))
    ch = f"{100 * (b / a - 1):+.1f} %" if a and b else ""
    fmt = lambda x: f"{x:.3f}" if x is not None else "–"
    print(f"| {c} | {kind} | {fmt(a)} | {fmt(b)} | {ch} |")
PY
tar -C "$out" -cJf "$out/runs.tar.xz" runs && rm -rf "$runs"
