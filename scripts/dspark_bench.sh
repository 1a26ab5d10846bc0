#!/usr/bin/env bash
# Issue 15's benchmark hook (called by `scripts/dspark_lease.sh bench`; docs/spec_decode.md,
# "The benchmark hook"): plain vs DSpark speculative decoding of the trained target through
# `ferry up`, same engine, model and held-out prompts in one run. Arm `plain`: `ferry up` without
# a drafter (`--speculative off`); arm `spec`: `--drafter $DRAFTER_DIR --speculative on`. Each
# arm: start the cluster, wait until it answers, warm up, drive `/v1/completions` (streamed,
# token-id prompts) at each concurrency and temperature, stop the cluster. The load generator is
# scripts/dspark_bench.py (standard library only).
#
#   TARGET_DIR=… DRAFTER_DIR=… PROMPTS=….jsonl FERRY=… RUN=… DEVICE=cuda bash scripts/dspark_bench.sh
#
# Writes $RUN/bench/dspark_bench.{json,md} (the JSON after every level) and the clusters' logs
# under $RUN/bench/logs/. Exit status: 0 when both arms ran, 1 when one failed (recorded in the
# JSON), 124 when the hook's own time limit cut it.
#
# Settings (environment; defaults for the H200):
#   BENCH_CONCURRENCY=1,4,16,64,128   BENCH_TEMPERATURES=0,0.7   BENCH_ARMS=plain,spec,spec_fixed
#   BENCH_FIXED_VERIFY_LEN=fixed:B (B: the drafter's block size; the spec_fixed arm: the same
#     drafter verifying every draft of a block, the comparison for the confidence-scheduled arm)
#   BENCH_FIXED_CONCURRENCY=1,16,64 (the spec_fixed and spec_env arms' levels, greedy only)
#   BENCH_ENV_ARM="VAR=value ..." (the spec_env arm: the spec arm's cluster with these set, e.g.
#     FERRY_GOODPUT_PROMPTS=1; add spec_env to BENCH_ARMS: a switch against its default in one run)
#   BENCH_REQUESTS=auto (per level: max(16, 2c); or one number; or c:n,c:n)
#   BENCH_PROMPT_TOKENS=1024 (cut to the model's context - output - 1)   BENCH_OUTPUT_TOKENS=400
#   BENCH_SECONDS=480: budget of both arms together (each arm gets half of what is left: start-up,
#     warm-up, levels; a level that does not fit is recorded as skipped); the hook is killed at
#     BENCH_SECONDS + BENCH_GRACE (default 120: requests in flight, the last cluster's stop)
#   BENCH_MAX_RUNNING=max(128, the largest level)  BENCH_KV_BLOCKS=max(4096, 32 per running
#     sequence: 2,048 tokens of 64-token blocks, a 1,024 + 400 request and its drafts)
#   BENCH_PREFILL_WORKERS=1  BENCH_GPU_MODE=fast
#   BENCH_VERIFY_LEN=goodput  BENCH_MAX_VERIFY_TOKENS=1024  (the spec arms' ferry up flags: a budget
#   that lets every one of 128 sequences verify a whole block of 8, so the policy decides, not the cap)
#   BENCH_UP_ARGS: more `ferry up` flags for both arms   BENCH_WARMUP_TOKENS=16 (0: no warm-up)
#   BENCH_READY_SECONDS=240  BENCH_REQUEST_SECONDS=180   PY=python3
#   BENCH_CLIENT_PROCS=min(8, cores / 2): the processes the clients run on. One Python process
#     parses only ~40-50k streamed chunks a second, and the cluster served more than that at
#     c >= 64 on an H100 (BENCHMARKS.md, session 52). Every run first measures what the load
#     generator alone sustains at the largest level (`client_ceiling` in the JSON).
#   BENCH_REPEATS=1: run the whole bench (every arm and level) this many times, each with its own
#     BENCH_SECONDS; the first writes $RUN/bench/dspark_bench.{json,md} as before, repeat N also
#     $RUN/bench/dspark_bench_rN.{json,md}. One cluster run of a level differs from the next by
#     up to ~8 % (plain) and ~16 % (spec) on an H100 (BENCHMARKS.md, session 45): repeat before
#     reading a ratio near a bar.
set -uo pipefail
cd "$(dirname "$0")/.."

: "${TARGET_DIR:?TARGET_DIR: the target model directory}"
: "${DRAFTER_DIR:?DRAFTER_DIR: the drafter directory}"
: "${PROMPTS:?PROMPTS: held-out prompts (scripts/heldout_prompts.py JSON lines)}"
: "${RUN:?RUN: the lease directory (results go to \$RUN/bench)}"
FERRY=${FERRY:-}
[ -n "$FERRY" ] || { echo "dspark-bench: no ferry binary (FERRY)"; exit 2; }
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
BENCH_SECONDS=${BENCH_SECONDS:-480}
BENCH_GRACE=${BENCH_GRACE:-120}
for f in "$TARGET_DIR/config.json" "$DRAFTER_DIR/config.json" "$PROMPTS" "$FERRY"; do
  [ -e "$f" ] || { echo "dspark-bench: $f missing"; exit 2; }
done
if [ "$DEVICE" != cpu ] && [ -z "${DSPARK_BENCH_NO_GPU_ENV:-}" ]; then
  # cudarc loads libnvrtc / libcublas at run time (docs/gpu.md); the lease sourced it already.
  set +u; source scripts/gpu_env.sh >/dev/null; set -u
fi
mkdir -p "$RUN/bench"
export PYTHONUNBUFFERED=1
# Every level's clients decode at once: the largest level sets the workers' running limit and
# KV pool unless they are given (a level above the limit would measure the queue instead).
levels="${BENCH_CONCURRENCY:-1,4,16,64,128},${BENCH_FIXED_CONCURRENCY:-1,16,64}"
largest=$(tr ',' '\n' <<<"$levels" | grep -E '^[0-9]+$' | sort -n | tail -1)
largest=${largest:-128}
max_running=${BENCH_MAX_RUNNING:-$((largest > 128 ? largest : 128))}
kv_blocks=${BENCH_KV_BLOCKS:-$((32 * max_running > 4096 ? 32 * max_running : 4096))}
block=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["block_size"])' "$DRAFTER_DIR/config.json")
bench_once() {  # $1: output directory
timeout -k 20 "$((BENCH_SECONDS + BENCH_GRACE))" "$PY" scripts/dspark_bench.py \
  --ferry "$FERRY" --target "$TARGET_DIR" --drafter "$DRAFTER_DIR" --prompts "$PROMPTS" \
  --device "$DEVICE" --out "$1" \
  --arms "${BENCH_ARMS:-plain,spec,spec_fixed}" \
  --fixed-verify-len "${BENCH_FIXED_VERIFY_LEN:-fixed:$block}" \
  --fixed-concurrency "${BENCH_FIXED_CONCURRENCY:-1,16,64}" \
  --env-arm "${BENCH_ENV_ARM:-}" \
  --concurrency "${BENCH_CONCURRENCY:-1,4,16,64,128}" \
  --requests "${BENCH_REQUESTS:-auto}" \
  --temperatures "${BENCH_TEMPERATURES:-0,0.7}" \
  --prompt-tokens "${BENCH_PROMPT_TOKENS:-1024}" \
  --output-tokens "${BENCH_OUTPUT_TOKENS:-400}" \
  --max-running "$max_running" \
  --kv-blocks "$kv_blocks" \
  --prefill-workers "${BENCH_PREFILL_WORKERS:-1}" \
  --gpu-mode "${BENCH_GPU_MODE:-fast}" \
  --verify-len "${BENCH_VERIFY_LEN:-goodput}" \
  --max-verify-tokens "${BENCH_MAX_VERIFY_TOKENS:-1024}" \
  --up-args "${BENCH_UP_ARGS:-}" \
  --seconds "$BENCH_SECONDS" \
  --ready-seconds "${BENCH_READY_SECONDS:-240}" \
  --request-seconds "${BENCH_REQUEST_SECONDS:-180}" \
  --warmup-tokens "${BENCH_WARMUP_TOKENS:-16}" \
  ${BENCH_CLIENT_PROCS:+--client-procs "$BENCH_CLIENT_PROCS"}
}

repeats=${BENCH_REPEATS:-1}
status=0
for r in $(seq 1 "$repeats"); do
  if [ "$r" = 1 ]; then
    bench_once "$RUN/bench" || status=$?
  else
    echo "dspark-bench: repeat $r of $repeats"
    bench_once "$RUN/bench/repeat$r" || status=$?
    for ext in json md; do
      cp "$RUN/bench/repeat$r/dspark_bench.$ext" "$RUN/bench/dspark_bench_r$r.$ext" 2>/dev/null || true
    done
  fi
done
if [ "$repeats" -gt 1 ]; then
  "$PY" - "$RUN/bench" "$repeats" <<'EOF' || true
import json, sys
from pathlib import Path
out, n = Path(sys.argv[1]), int(sys.argv[2])
for r in range(1, n + 1):
    p = out / ("dspark_bench.json" if r == 1 else f"dspark_bench_r{r}.json")
    if not p.exists():
        print(f"dspark-bench: repeat {r}: no report")
        continue
    for t, sp in json.loads(p.read_text()).get("speedup", {}).items():
        print(f"dspark-bench: repeat {r} T={t}: peak aggregate ratio {sp.get('peak_aggregate_ratio')} "
              f"(plain {sp.get('plain_peak_aggregate_tok_s')}, spec {sp.get('spec_peak_aggregate_tok_s')})")
EOF
fi
exit "$status"
