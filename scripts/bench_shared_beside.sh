#!/usr/bin/env bash
# Runs on the GPU machine (docs/gpu.md): issue 13's A/B of one token's shared expert beside the
# router (kernels/src/gpu/ops.rs `moe_token_beside`, `SharedBeside`) against the old launch order
# (`FERRY_SHARED_BESIDE=0`, the default), through scripts/bench_decode_arms.sh (the decode step
# of the V2-Lite shape, then the DSpark target's shape through the serving engine). ARMS here
# are values of FERRY_SHARED_BESIDE (default "0 graphs": beside in captured graphs only; `1`:
# eager steps too).
#   ROUNDS=3 BATCH=1 OUT=... bash scripts/bench_shared_beside.sh
set -euo pipefail
cd "$(dirname "$0")/.."
arms=""
for a in ${ARMS:-0 graphs}; do arms="$arms FERRY_SHARED_BESIDE=$a"; done
ARMS="$arms" exec bash scripts/bench_decode_arms.sh
