#!/usr/bin/env bash
# Runs on the GPU machine (docs/gpu.md): where a loaded speculative round goes, kernel family by
# kernel family (issues 13 and 15). On the DSpark lease pair's shape with seeded random weights
# (models/dummy/dspark-h200 + its drafter), `ferry bench-engine --speculative` at LEVEL
# sequences (128) with VERIFY (fixed:4: every sequence verifies that many drafts, one uniform
# graph). A first run lists the kernels launched (`FERRY_PROFILE_TWICE=none` names each on its
# first lookup); then each family (the name up to its first `_`, e.g. all `moe_*`) is queued
# twice in a run of its own, and the growth of the plain step, of the round's drafter pass
# (plan) and of its verify wait (sample) over the base run is that family's cost inside the
# (graph-replayed) step. cuBLAS GEMMs are not launched through ferry's launcher: what the
# families do not explain is theirs and the host's. Results are wrong under the switch (in-place
# kernels apply twice; the dummy drafts are never accepted anyway): the times are what counts.
#   LEVEL=128 VERIFY=fixed:4 [FAMILIES="moe mla"] OUT=... bash scripts/bench_round_kernels.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-logs}"
mkdir -p "$out"
# shellcheck disable=SC1091
source scripts/gpu_env.sh >/dev/null
ferry=${FERRY:-./device-bin/ferry}
level=${LEVEL:-128}
verify=${VERIFY:-fixed:4}
# run NAME [VAR=VALUE ...]: one bench-engine run; prints "plain round plan sample" ms.
run() {
  local name=$1
  shift
  env "$@" timeout "${RUN_TIMEOUT:-120}" "$ferry" bench-engine --speculative --load-format dummy \
    --model models/dummy/dspark-h200 --drafter models/dummy/dspark-h200-drafter --device cuda \
    --gpu-mode fast --batch "$level" --prompt-len "${PROMPT_LEN:-1024}" \
    --decode-steps "${DECODE_STEPS:-128}" --requests "$level" --waves 1 --temperature 0 \
    --verify-len "$verify" --json "$out/$name.json" >"$out/$name.log" 2>&1
  python3 - "$out/$name.json" <<'PY' 2>/dev/null || echo "- - - -"
import json, sys
r = json.load(open(sys.argv[1]))["rows"][0]["engine_steps"]
p, q = r["plain"]["decode"], r["spec"]["spec_round"]
print(f"{p['ms']:.3f} {q['ms']:.3f} {q['plan_ms']:.3f} {q['sample_ms']:.3f}")
PY
}
read -r b_plain b_round b_plan b_sample < <(run base FERRY_PROFILE_TWICE=none)
echo "level $level, $verify: base plain step $b_plain ms, round $b_round ms (drafter pass $b_plan, verify wait $b_sample)"
echo
echo "| family | kernels | plain step + ms | round + ms | drafter pass + ms | verify wait + ms |"
echo "|---|---|---|---|---|---|"
mapfile -t kernels < <(sed -n 's/^FERRY_PROFILE_TWICE: kernel \([A-Za-z0-9_]*\).*/\1/p' "$out/base.log" | sort -u)
# FAMILIES (space-separated) limits the runs to those families, in that order.
for fam in ${FAMILIES:-$(printf '%s\n' "${kernels[@]}" | sed 's/_.*//' | sort -u)}; do
  names=$(printf '%s\n' "${kernels[@]}" | grep "^${fam}\(_\|$\)" | paste -sd, -)
  read -r plain round plan sample < <(run "twice_$fam" FERRY_PROFILE_TWICE="$names")
  python3 -c "
d = lambda a, b: f'{a - b:+.3f}'
print(f'| \`$fam\` | ${names//,/ } | {d($plain, $b_plain)} | {d($round, $b_round)} | {d($plan, $b_plan)} | {d($sample, $b_sample)} |')" \
    2>/dev/null || echo "| \`$fam\` | ${names//,/ } | (no result) | | | |"
done
