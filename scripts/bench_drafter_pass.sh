#!/usr/bin/env bash
# Runs on the GPU machine (docs/gpu.md): where a DSpark drafter pass's time goes on the
# DeepSeek-V2-Lite shape (issue 15). `ferry bench-engine --verify-cost` at batch 1 (dummy
# weights), first once per drafter block size (BLOCKS: how the pass grows with the Markov head's
# serial positions), then once per kernel of KERNELS launched twice (`FERRY_PROFILE_TWICE`: the
# drafter pass's growth is that kernel's cost inside the pass; results are wrong under it, the
# times are what counts). The baseline run lists every kernel the bench launches.
#   BLOCKS="4 8 16" KERNELS="sample_argmax add_rms_norm ..." scripts/bench_drafter_pass.sh
# Environment: FERRY (default ./device-bin/ferry), BATCH (1), OUT (logs; else ./gpu-logs),
# TEMPS (draft temperatures timed at block 16 besides greedy; default 0.7: a sampled pass).
# Kernels a build does not launch double nothing (the row equals the baseline): the default
# list names both the one-launch Markov step (draft_markov_*, the split argmax) and the
# launches it replaced, so one list profiles a build from before it too.
set -uo pipefail
cd "$(dirname "$0")/.."
FERRY=${FERRY:-./device-bin/ferry}
out="${OUT:-gpu-logs}"
mkdir -p "$out"
# shellcheck disable=SC1091
source scripts/gpu_env.sh >/dev/null
base=models/dummy/v2-lite-drafter/config.json
cost() { # drafter config, an env assignment, then extra bench-engine flags
  local cfg=$1 envset=$2
  shift 2
  env "$envset" timeout "${RUN_TIMEOUT:-60}" "$FERRY" bench-engine --verify-cost --device cuda \
    --gpu-mode fast --load-format dummy --model models/dummy/deepseek-v2-lite \
    --drafter-config "$cfg" --batch "${BATCH:-1}" --prompt-len 1024 --verify-k 1 "$@" 2>&1
}
echo "| drafter block | decode step ms | drafter pass ms (eager / graph) |"
echo "|---|---|---|"
for blk in ${BLOCKS:-4 8 16}; do
  dir=$(mktemp -d)
  python3 -c "import json,sys; c=json.load(open(sys.argv[1])); c['block_size']=int(sys.argv[2]); json.dump(c,open(sys.argv[3],'w'))" \
    "$base" "$blk" "$dir/config.json"
  # FERRY_PROFILE_TWICE naming no kernel lists what runs (stderr) and doubles nothing.
  cost "$dir/config.json" FERRY_PROFILE_TWICE=none >"$out/drafter_block_$blk.log"
  grep '^| 1 | 1 |' "$out/drafter_block_$blk.log" | awk -F'|' -v b="$blk" '{print "| " b " |" $4 "|" $7 "|"}'
done
echo
echo "| draft temperature (block 16) | decode step ms | drafter pass ms (eager / graph) |"
echo "|---|---|---|"
for t in ${TEMPS:-0.7}; do
  cost "$base" FERRY_PROFILE_TWICE=none --temperature "$t" >"$out/drafter_temp_$t.log"
  grep '^| 1 | 1 |' "$out/drafter_temp_$t.log" | awk -F'|' -v t="$t" '{print "| " t " |" $4 "|" $7 "|"}'
done
echo
echo "| kernel launched twice | decode step ms | drafter pass ms (eager / graph) |"
echo "|---|---|---|"
for k in ${KERNELS:-draft_markov_bf16 sample_argmax_part sample_argmax_merge sample_argmax add_rms_norm gather_rows embed_bf16 gemv_bf16 draft_attn_bf16_q16_d128 draft_attn_combine}; do
  cost "$base" FERRY_PROFILE_TWICE="$k" >"$out/drafter_twice_$k.log"
  grep '^| 1 | 1 |' "$out/drafter_twice_$k.log" | awk -F'|' -v k="$k" '{print "| " k " |" $4 "|" $7 "|"}'
done
echo
echo "kernels launched (block 16):"
grep -o 'FERRY_PROFILE_TWICE: kernel [a-z_0-9]*' "$out/drafter_block_16.log" | awk '{print $3}' | tr '\n' ' '
echo
