#!/usr/bin/env bash
# Runs on the GPU machine (docs/gpu.md): what a DSpark drafter pass costs on the
# DeepSeek-V2-Lite shape and where its time goes (issue 15). `ferry bench-engine --verify-cost`
# at batch 1 (dummy weights), in three tables:
#   1. arms (ROUNDS times, default 1, interleaved), greedy and sampled at T = 0.7: session 30's one-launch
#      Markov step and split sampling rows (the default), each switched off
#      (FERRY_MARKOV_FUSED=0, FERRY_SPLIT_ROWS=0), and both off (the pass as before session 30);
#   2. the drafter block size (BLOCKS: how the pass grows with the Markov head's serial steps);
#   3. one row per kernel of KERNELS launched twice (FERRY_PROFILE_TWICE: the pass's growth is
#      that kernel's cost inside it; results are wrong under it, the times are what counts). A
#      kernel a build does not launch doubles nothing.
#   ROUNDS=1 BLOCKS="4 8 16" KERNELS="draft_markov_bf16 ..." scripts/bench_drafter_pass.sh
# Environment: FERRY (default ./device-bin/ferry), BATCH (1), OUT (logs; else ./gpu-logs).
set -uo pipefail
cd "$(dirname "$0")/.."
FERRY=${FERRY:-./device-bin/ferry}
out="${OUT:-gpu-logs}"
mkdir -p "$out"
# shellcheck disable=SC1091
source scripts/gpu_env.sh >/dev/null
base=models/dummy/v2-lite-drafter/config.json
# cost LOG CONFIG [VAR=VALUE ...] [-- bench-engine flags]: one run into LOG, its batch-1 row out.
cost() {
  local log=$1 cfg=$2
  shift 2
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  env "${envs[@]}" timeout "${RUN_TIMEOUT:-60}" "$FERRY" bench-engine --verify-cost --device cuda \
    --gpu-mode fast --load-format dummy --model models/dummy/deepseek-v2-lite \
    --drafter-config "$cfg" --batch "${BATCH:-1}" --prompt-len 1024 --verify-k 1 "$@" >"$log" 2>&1
  grep "^| ${BATCH:-1} | 1 |" "$log" | awk -F'|' '{print $4 "|" $7}'
}
echo "| arm | drafts | decode step ms | drafter pass ms (eager / graph) |"
echo "|---|---|---|---|"
arms=("default:FERRY_PROFILE_TWICE=none" "markov-7-launches:FERRY_MARKOV_FUSED=0"
  "one-block-rows:FERRY_SPLIT_ROWS=0" "before-session-30:FERRY_MARKOV_FUSED=0,FERRY_SPLIT_ROWS=0")
for round in $(seq "${ROUNDS:-1}"); do
  for t in 0 0.7; do
    for arm in "${arms[@]}"; do
      name=${arm%%:*}
      IFS=, read -r -a envs <<<"${arm#*:}"
      row=$(cost "$out/drafter_arm_${name}_t${t}_r$round.log" "$base" "${envs[@]}" -- --temperature "$t")
      echo "| $name | T = $t |$row|"
    done
  done
done
echo
echo "| drafter block | decode step ms | drafter pass ms (eager / graph) |"
echo "|---|---|---|"
for blk in ${BLOCKS:-4 8 16}; do
  dir=$(mktemp -d)
  python3 -c "import json,sys; c=json.load(open(sys.argv[1])); c['block_size']=int(sys.argv[2]); json.dump(c,open(sys.argv[3],'w'))" \
    "$base" "$blk" "$dir/config.json"
  # FERRY_PROFILE_TWICE naming no kernel lists what runs (stderr) and doubles nothing.
  echo "| $blk |$(cost "$out/drafter_block_$blk.log" "$dir/config.json" FERRY_PROFILE_TWICE=none)|"
done
echo
echo "| kernel launched twice | decode step ms | drafter pass ms (eager / graph) |"
echo "|---|---|---|"
for k in ${KERNELS:-draft_markov_bf16 sample_argmax_part gemv_bf16 draft_attn_bf16_q16_d128 draft_attn_combine add_rms_norm}; do
  echo "| $k |$(cost "$out/drafter_twice_$k.log" "$base" FERRY_PROFILE_TWICE="$k")|"
done
echo
echo "kernels launched (block 16):"
grep -o 'FERRY_PROFILE_TWICE: kernel [a-z_0-9]*' "$out/drafter_block_16.log" | awk '{print $3}' | tr '\n' ' '
echo
