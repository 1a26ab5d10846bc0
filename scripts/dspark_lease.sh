#!/usr/bin/env bash
# One GPU lease for issue 15 (docs/spec_decode.md, "Training a target worth speculating on"):
# train the target from scratch, train its DSpark drafter, make held-out prompts, check that ferry
# loads the pair, and run the benchmark hook — unattended, everything under $RUN (git-ignored),
# which survives between device calls of one lease but not the lease.
#
#   scripts/dspark_lease.sh STAGE...
#
# Stages (each fits one 10-minute device command; run in this order):
#   target    scripts/train_target.py --preset $PRESET          -> $RUN/target     (~7 min on an H200)
#   drafter   make_tiny_k3.py train-drafter against $RUN/target -> $RUN/drafter    (~6 min)
#   prompts   scripts/heldout_prompts.py                        -> $RUN/prompts-$PROMPT_TOKENS.jsonl
#   check     ferry generate, plain and speculative, greedy: loads the pair, same text (needs ferry)
#   bench     the benchmark hook $BENCH_HOOK (scripts/dspark_bench.sh: plain vs speculative through
#             `ferry up`; at PRESET=tiny with CPU-sized BENCH_* defaults)
#   engine    the same pair in-process on the GPU, no cluster: `ferry bench-engine --speculative
#             --device cuda` under goodput and fixed:B, plain in the same command, with the
#             drafter pass / verify forward / decode step timed apart; ENGINE_REQUESTS (16)
#             requests per level, c at a time, so c = 1 is not one prompt's luck, and at least
#             ENGINE_WAVES (3) times c, so a level is its steady state, not one wave's ramp and
#             tail (one wave before session 37); then the first
#             verify length at ENGINE_TEMPS (0.7), and under each arm of ENGINE_AB (VAR=value
#             or VAR=value@levels, space-separated; unset: none) at its levels or
#             ENGINE_AB_BATCH (1)                                     -> $RUN/bench/engine_spec.json
#   knobs     plain decoding of the trained target through the serving engine (`bench-engine
#             --serving`: eager and graphs; batches 64, 96, 128; 512 steps) under session 23's open
#             A/B switches: FERRY_GRAPH_MAX_BATCH=256 (graphs past 64 sequences) and
#             FERRY_HEAD_GEMM_MIN / FERRY_SHARED_GEMM_MIN off, alone and together, twice,
#             interleaved; its shape with dummy weights when there is no trained target
#                                                               -> $RUN/bench/knobs.md (not in `all`)
#   rounds    a speculating engine's step costs on the pair's shape with dummy weights (no training
#             needed): `bench-engine --speculative --load-format dummy` on models/dummy/dspark-h200
#             + its drafter, fixed:8, c = 1 / 16 / 64 / 128  -> $RUN/bench/rounds.{json,md} (not in `all`)
#   verifycost  the regime of a large model: `ferry bench-engine --verify-cost` on the
#             DeepSeek-V2-Lite-shaped model (dummy weights) with a drafter of
#             models/dummy/v2-lite-drafter's size: decode step, verify forward of k + 1 rows and
#             drafter pass per batch; the speed-up at the trained pair's held-out τ computed from
#             them                                               -> $RUN/bench/verify_cost.json
#             and the drafter pass sampled at VERIFY_TEMPS (0.7), batch 1 / 16
#                                                        -> $RUN/bench/verify_cost_t0.7.json
#   cpu       the same pair on the GPU machine's CPU cores: `ferry bench-engine --speculative
#             --device cpu` under goodput and confidence:0.3        -> $RUN/bench/cpu_spec.json
#   summary   the numbers of every report so far
# Chains:
#   all       target drafter prompts check bench engine cpu verifycost summary (longer than one device
#             command; verifycost last: session 19 measured it with session 17's τ, BENCHMARKS.md)
#   start     `all` in the background (setsid: it outlives the device command), then `wait`;
#             LEASE_STAGES="target drafter ..." runs those stages instead of `all` (a lease that
#             has fewer device-minutes than the whole chain)
#   wait      wait for the background run for at most $WAIT_SECONDS (default 570), print the stages
#             so far and the log's last lines (the whole log comes back as lease.log), then summary;
#             call it again AT ONCE (the machine is given back 30 s after a command ends, and the
#             run with it: session 19 lost a trained pair so) until it says "finished"
#   smoke     the whole chain with PRESET=tiny on the CPU (minutes; bench only with FERRY set)
#
# The device command for a lease (one H200; corpus from scripts/make_corpus.py, ferry as
# `xz -T0 -k device-bin/ferry` since ferry + corpus + tree exceed the 64 MiB carry otherwise):
#   run(carry=["corpus", "device-bin/ferry.xz"], timeout_s=600,
#       command="bash scripts/dspark_lease.sh start")
#   run(timeout_s=600, command="bash scripts/dspark_lease.sh wait")     # again until "finished"
#
# Settings (environment):
#   PRESET=h200|tiny   CORPUS=corpus   RUN=train-out   PY=python3   DEVICE=(auto: cuda if present)
#   TARGET_MINUTES (h200 6, tiny 1.5)   DRAFTER_SECONDS: drafter training loop budget (h200 200)
#   DRAFTER_ARGS: extra make_tiny_k3.py train-drafter options (e.g. --drafter-block-size 16)
#   FERRY: a ferry binary (default: device-bin/ferry, device-bin/ferry.xz unpacked, target/release/ferry)
#   PROMPT_TOKENS (h200 1024, tiny 64), PROMPT_COUNT (8192: at least a bench run's requests, warm-up
#     included, so that no request finds its prompt in the prefix cache; the held-out split gives
#     that many 1,024-token windows by overlapping them, scripts/heldout_prompts.py)
#   BENCH_HOOK=scripts/dspark_bench.sh: run as `bash $BENCH_HOOK` with TARGET_DIR, DRAFTER_DIR,
#     PROMPTS, FERRY, RUN, DEVICE exported; it writes its results under $RUN/bench/ (its own
#     BENCH_* settings: scripts/dspark_bench.sh); a failed hook is reported, the chain goes on
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

PRESET=${PRESET:-h200}
CORPUS=${CORPUS:-corpus}
RUN=${RUN:-train-out}
PY=${PY:-python3}
BENCH_HOOK=${BENCH_HOOK:-scripts/dspark_bench.sh}
WAIT_SECONDS=${WAIT_SECONDS:-570}
PROMPT_COUNT=${PROMPT_COUNT:-8192}
if [ "$PRESET" = tiny ]; then
  TARGET_MINUTES=${TARGET_MINUTES:-1.5}
  DRAFTER_SECONDS=${DRAFTER_SECONDS:-60}
  PROMPT_TOKENS=${PROMPT_TOKENS:-64}
  # A drafter run sized for a CPU: minutes, not hours (the data and the loop scale down together).
  # The h200 preset's shape at the tiny scale: a long part of 64-token prompts (PROMPT_TOKENS)
  # with a 32-token tail, anchors from position 24.
  DRAFTER_PRESET="--drafter-steps 40 --drafter-batch 16 --drafter-anchors 8 --drafter-seqs 128
    --drafter-eval-seqs 16 --drafter-seq-len 80 --drafter-prompt-lens 8,16 --drafter-gen-batch 128
    --drafter-eval-every 20 --drafter-eval-batch 8 --drafter-eval-stride 4 --drafter-calib-steps 20
    --drafter-log-every 10 --drafter-corpus-mb 1 --drafter-pack-splits
    --drafter-long-prompt-lens 64 --drafter-long-seq-len 96 --drafter-long-seqs 32
    --drafter-long-eval-seqs 8 --drafter-anchor-from 24"
else
  TARGET_MINUTES=${TARGET_MINUTES:-6}
  DRAFTER_SECONDS=${DRAFTER_SECONDS:-200}
  PROMPT_TOKENS=${PROMPT_TOKENS:-1024}
  # Serving-shaped data (docs/spec_decode.md, "The drafter against it"): the short part (greedy
  # continuations of 16- and 64-token prompts to 192 tokens; 3,584 + 2 x 256 held out, one generate
  # call of 2,048 per prompt length: 304 generated steps) and a long part (1,024-token corpus
  # prompts, PROMPT_TOKENS, + 64 greedy tokens; 336 + 2 x 72 held out in 2 calls of 240: 128
  # steps); anchors from position 512, a quarter of each step's sequences long, half of their
  # anchors in the tail. Checkpoint choice and confidence calibration on the long validation
  # tail. Estimated data ~2 min (HF generate ~0.26 s per step as measured at 2048 x 192).
  DRAFTER_PRESET="--drafter-seqs 3584 --drafter-eval-seqs 256 --drafter-seq-len 192
    --drafter-prompt-lens 16,64 --drafter-gen-batch 2048 --drafter-pack-splits
    --drafter-long-prompt-lens 1024 --drafter-long-seq-len 1088 --drafter-long-seqs 336
    --drafter-long-eval-seqs 72 --drafter-long-gen-tokens 262144 --drafter-anchor-from 512
    --drafter-long-share 0.25 --drafter-long-tail-share 0.5"
fi
DRAFTER_ARGS=${DRAFTER_ARGS:-}
DEVICE_ARG=()
[ -n "${DEVICE:-}" ] && DEVICE_ARG=(--device "$DEVICE")
mkdir -p "$RUN/logs"

ferry_bin() {
  if [ -n "${FERRY:-}" ]; then echo "$FERRY"; return; fi
  if [ -x device-bin/ferry ]; then echo device-bin/ferry; return; fi
  if [ -f device-bin/ferry.xz ]; then
    mkdir -p "$RUN/bin"
    if [ ! -x "$RUN/bin/ferry" ] || [ device-bin/ferry.xz -nt "$RUN/bin/ferry" ]; then
      xz -dc device-bin/ferry.xz > "$RUN/bin/ferry" && chmod +x "$RUN/bin/ferry"
    fi
    echo "$RUN/bin/ferry"; return
  fi
  if [ -x target/release/ferry ]; then echo target/release/ferry; return; fi
  echo ""
}

# The ferry binary for a stage that measures on the GPU; prints nothing and fails (the reason in
# the log) where it cannot run: no binary, or a CPU / tiny lease. The caller then sources
# scripts/gpu_env.sh in its own shell (cudarc loads libnvrtc / libcublas at run time).
gpu_stage_ferry() {  # stage, why it needs a GPU
  local ferry
  ferry=$(ferry_bin)
  if [ -z "$ferry" ]; then echo "lease: $1 skipped: no ferry binary" >&2; return 1; fi
  if [ "${DEVICE:-cuda}" = cpu ] || [ "$PRESET" = tiny ]; then
    echo "lease: $1 skipped: $2" >&2; return 1
  fi
  echo "$ferry"
}

stage_target() {
  for f in train.txt.xz heldout.txt.xz tokenizer.json tokenizer_config.json; do
    [ -f "$CORPUS/$f" ] || { echo "lease: $CORPUS/$f missing: run scripts/make_corpus.py and carry $CORPUS"; exit 2; }
  done
  ls -l "$CORPUS"
  "$PY" -c 'import torch, transformers, tokenizers; print("lease: torch", torch.__version__, "transformers", transformers.__version__, "tokenizers", tokenizers.__version__, "cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))'
  "$PY" scripts/train_target.py --preset "$PRESET" --corpus "$CORPUS" --out "$RUN/target" \
    --minutes "$TARGET_MINUTES" "${DEVICE_ARG[@]}" 2>&1 | tee "$RUN/logs/target.log"
}

stage_drafter() {
  [ -f "$RUN/target/config.json" ] || { echo "lease: no $RUN/target: run the target stage first"; exit 2; }
  # shellcheck disable=SC2086
  "$PY" scripts/make_tiny_k3.py train-drafter --out "$RUN/target" --drafter-out "$RUN/drafter" \
    --corpus "$CORPUS" --drafter-time-budget "$DRAFTER_SECONDS" "${DEVICE_ARG[@]}" \
    $DRAFTER_PRESET $DRAFTER_ARGS 2>&1 | tee "$RUN/logs/drafter.log"
}

stage_prompts() {
  "$PY" scripts/heldout_prompts.py --corpus "$CORPUS" --model "$RUN/target" \
    --tokens "$PROMPT_TOKENS" --count "$PROMPT_COUNT" --out "$RUN/prompts-$PROMPT_TOKENS.jsonl"
}

stage_check() {
  local ferry dev
  ferry=$(ferry_bin)
  if [ -z "$ferry" ]; then echo "lease: check skipped: no ferry binary (FERRY, device-bin/ferry[.xz])"; return; fi
  dev=${DEVICE:-auto}
  if [ "$dev" != cpu ]; then
    # cudarc loads libnvrtc / libcublas at run time (docs/gpu.md); gpu_env.sh is not `set -u` clean.
    set +u; source scripts/gpu_env.sh; set -u
  fi
  local prompt
  prompt=$("$PY" -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["prompt"][-400:])' \
    "$RUN/prompts-$PROMPT_TOKENS.jsonl" 2>/dev/null || echo "def main():")
  echo "lease: ferry generate --device $dev --model $RUN/target (greedy, 48 tokens), plain then speculative"
  "$ferry" generate --device "$dev" --model "$RUN/target" --prompt "$prompt" --max-tokens 48 \
    --speculative off > "$RUN/logs/check_plain.txt" 2> "$RUN/logs/check_plain.err" \
    || { cat "$RUN/logs/check_plain.err"; echo "lease: ferry REJECTED the target"; exit 3; }
  "$ferry" generate --device "$dev" --model "$RUN/target" --drafter "$RUN/drafter" --speculative on \
    --prompt "$prompt" --max-tokens 48 > "$RUN/logs/check_spec.txt" 2> "$RUN/logs/check_spec.err" \
    || { cat "$RUN/logs/check_spec.err"; echo "lease: ferry REJECTED the drafter"; exit 3; }
  tail -n 3 "$RUN/logs/check_plain.err" "$RUN/logs/check_spec.err" || true
  if cmp -s "$RUN/logs/check_plain.txt" "$RUN/logs/check_spec.txt"; then
    echo "lease: check: ferry loaded target and drafter; greedy plain == speculative"
  else
    echo "lease: check: ferry loaded both, but greedy plain != speculative (see $RUN/logs/check_*.txt)"
  fi
  "$PY" -c 'import sys; print("lease: greedy text:", repr(open(sys.argv[1]).read()[:400]))' "$RUN/logs/check_plain.txt"
  # Online against offline on the same text: ferry's rounds (exact mode: f32 like the reference)
  # replayed with the torch drafter that trained it (scripts/spec_replay.py; docs/spec_decode.md).
  local gm=()
  [ "$dev" != cpu ] && gm=(--gpu-mode exact)
  echo "lease: check: replaying ferry's rounds (fixed:8, 128 tokens${gm:+, exact mode}) with the torch drafter"
  if FERRY_LOG=warn,ferry_model=trace "$ferry" generate --device "$dev" "${gm[@]}" --model "$RUN/target" \
       --drafter "$RUN/drafter" --speculative on --verify-len fixed:8 --ignore-eos --prompt "$prompt" \
       --max-tokens 128 > "$RUN/logs/replay.txt" 2> "$RUN/logs/replay.log"; then
    "$PY" scripts/spec_replay.py --target "$RUN/target" --drafter "$RUN/drafter" --prompt "$prompt" \
      --max-tokens 128 --ferry "$RUN/logs/replay.log" --device "$([ "$dev" = cpu ] && echo cpu || echo cuda)" \
      --json "$RUN/logs/replay.json" 2>&1 | grep -v '^Loading' \
      || echo "lease: check: ferry's rounds differ from the reference's (see $RUN/logs/replay.json)"
  else
    echo "lease: check: the replay run failed (see $RUN/logs/replay.log)"
  fi
}

stage_bench() {
  export TARGET_DIR="$RUN/target" DRAFTER_DIR="$RUN/drafter" PROMPTS="$RUN/prompts-$PROMPT_TOKENS.jsonl"
  export RUN DEVICE="${DEVICE:-cuda}" FERRY PY
  FERRY=$(ferry_bin)
  if [ "$PRESET" = tiny ]; then
    # A CPU-sized run of the hook (its defaults are the H200's): short outputs, two levels.
    export BENCH_CONCURRENCY=${BENCH_CONCURRENCY:-1,2} BENCH_REQUESTS=${BENCH_REQUESTS:-2} \
      BENCH_FIXED_CONCURRENCY=${BENCH_FIXED_CONCURRENCY:-1,2} \
      BENCH_OUTPUT_TOKENS=${BENCH_OUTPUT_TOKENS:-32} BENCH_KV_BLOCKS=${BENCH_KV_BLOCKS:-256} \
      BENCH_MAX_RUNNING=${BENCH_MAX_RUNNING:-8} BENCH_SECONDS=${BENCH_SECONDS:-240}
  else
    # Three arms (plain, spec, spec_fixed at half weight): a minute more than two had.
    export BENCH_SECONDS=${BENCH_SECONDS:-540}
  fi
  if [ "$DEVICE" != cpu ]; then set +u; source scripts/gpu_env.sh; set -u; fi
  if [ -f "$BENCH_HOOK" ]; then
    mkdir -p "$RUN/bench"
    bash "$BENCH_HOOK" 2>&1 | tee "$RUN/logs/bench.log" \
      || echo "lease: bench: the hook exited with ${PIPESTATUS[0]} (see $RUN/bench/dspark_bench.json)"
  else
    echo "lease: bench: no $BENCH_HOOK yet. Its contract: run as 'bash $BENCH_HOOK' from the repo root"
    echo "  with TARGET_DIR=$TARGET_DIR DRAFTER_DIR=$DRAFTER_DIR PROMPTS=$PROMPTS (JSON lines:"
    echo "  prompt, prompt_tokens, ids) FERRY=${FERRY:-<none>} DEVICE=$DEVICE RUN=$RUN; write results"
    echo "  under \$RUN/bench/ (the lease's wait stage copies \$RUN/bench/*.json and *.md to \$OUT)"
  fi
}

stage_engine() {
  # Speculative against plain in the engine alone (the cluster's router, gRPC and streaming
  # left out), on the lease's trained pair: if this pays and `bench` does not, the cluster path
  # is where the time goes.
  local ferry
  ferry=$(gpu_stage_ferry engine "it measures the trained pair on a GPU") || return 0
  set +u; source scripts/gpu_env.sh; set -u
  mkdir -p "$RUN/bench"
  : > "$RUN/bench/engine_spec.md"
  local v t parts=()
  # One command: label, JSON file, verify length, batches, then `env` settings (may be none).
  engine_run() {
    local label=$1 f=$2 v=$3 batch=$4
    shift 4
    echo "lease: engine: $* ferry bench-engine --speculative --device cuda --verify-len $v --temperature ${ENGINE_T:-0} --batch $batch" \
      | tee -a "$RUN/bench/engine_spec.md"
    env "$@" timeout "${ENGINE_SECONDS:-150}" "$ferry" bench-engine --speculative --device cuda --gpu-mode fast \
      --model "$RUN/target" --drafter "$RUN/drafter" --batch "$batch" --temperature "${ENGINE_T:-0}" \
      --prompt-len "${ENGINE_PROMPT_LEN:-1024}" --decode-steps "${ENGINE_DECODE_STEPS:-512}" --repeat 1 \
      --requests "${ENGINE_REQUESTS:-16}" --waves "${ENGINE_WAVES:-3}" --prompts "$RUN/prompts-$PROMPT_TOKENS.jsonl" \
      --verify-len "$v" --max-verify-tokens "${BENCH_MAX_VERIFY_TOKENS:-1024}" --json "$f" 2>&1 \
      | grep '^|' | tee -a "$RUN/bench/engine_spec.md" || echo "lease: engine: $label did not finish (the levels it did are kept)"
    [ -f "$f" ] && parts+=("$label=$f")
  }
  local lens=(${ENGINE_VERIFY_LENS:-goodput fixed:8}) batch=${ENGINE_BATCH:-1,16,64,128}
  for v in "${lens[@]}"; do
    # One file per verify length (`fixed:4` and `fixed:8` apart: session 40 lost fixed:4 so).
    engine_run "$v" "$RUN/bench/.engine_spec_${v//:/_}.json" "$v" "$batch"
  done
  # Sampled requests (issue 15 asks for T = 0.7 as well): the first verify length at each of
  # ENGINE_TEMPS (default 0.7; empty for none).
  for t in ${ENGINE_TEMPS-0.7}; do
    ENGINE_T=$t engine_run "${lens[0]}@T$t" "$RUN/bench/.engine_spec_t$t.json" "${lens[0]}" "$batch"
  done
  # A/B settings (ENGINE_AB: space-separated VAR=value arms, each optionally @levels, e.g.
  # "FERRY_VERIFY_ARGMAX=0 FERRY_WHOLE_BLOCK_TAIL=0@16,64"), greedy, the first verify length, at
  # the arm's levels or ENGINE_AB_BATCH (default 1): the same binary's other arm.
  local arm ab_n=0
  for arm in ${ENGINE_AB:-}; do
    local setting=${arm%%@*} levels=${ENGINE_AB_BATCH:-1}
    [ "$setting" != "$arm" ] && levels=${arm#*@}
    ab_n=$((ab_n + 1))
    engine_run "${lens[0]}@${setting//=/:}" "$RUN/bench/.engine_spec_ab$ab_n.json" "${lens[0]}" \
      "$levels" "$setting"
  done
  "$PY" - "$RUN/bench/engine_spec.json" "${parts[@]}" <<'EOF2'
import json, sys
out = {"benchmark": "bench-engine --speculative --device cuda --gpu-mode fast, the lease's trained pair",
       "policies": {}}
for arg in sys.argv[2:]:
    v, f = arg.split("=", 1)
    out["policies"][v] = json.load(open(f))
open(sys.argv[1], "w").write(json.dumps(out, indent=1) + "\n")
EOF2
}

stage_knobs() {
  # Plain decoding of the trained target through the serving engine (`bench-engine --serving`:
  # eager and graph-replayed steps, prefill included) at serving length, under the A/B switches
  # session 23 left open (BENCHMARKS.md, "CUDA graphs past 64 sequences"): graphs past 64
  # sequences (FERRY_GRAPH_MAX_BATCH=256) and issue 13's batched cuBLAS paths turned off
  # (FERRY_HEAD_GEMM_MIN / FERRY_SHARED_GEMM_MIN past any batch), alone and together. Arms
  # interleaved and run twice. Without a trained target ($RUN/target) it measures the same shape
  # with seeded random weights (models/dummy/dspark-h200, `--load-format dummy`): plain decoding
  # costs the same whatever the weights (routing aside).
  local ferry model=() arm round
  ferry=$(gpu_stage_ferry knobs "the switches are the CUDA engine's") || return 0
  set +u; source scripts/gpu_env.sh; set -u
  if [ -f "$RUN/target/config.json" ]; then model=(--model "$RUN/target")
  else model=(--model models/dummy/dspark-h200 --load-format dummy); fi
  mkdir -p "$RUN/bench"
  local md="$RUN/bench/knobs.md"
  : > "$md"
  echo "lease: knobs: ${model[*]}" | tee -a "$md"
  local arms=("default" "FERRY_GRAPH_MAX_BATCH=256" "FERRY_HEAD_GEMM_MIN=1000000 FERRY_SHARED_GEMM_MIN=1000000"
    "FERRY_GRAPH_MAX_BATCH=256 FERRY_HEAD_GEMM_MIN=1000000 FERRY_SHARED_GEMM_MIN=1000000")
  for round in $(seq 1 "${KNOBS_ROUNDS:-2}"); do
    for arm in "${arms[@]}"; do
      echo "lease: knobs round $round: $arm" | tee -a "$md"
      # shellcheck disable=SC2086
      env $([ "$arm" = default ] || echo "$arm") timeout "${KNOBS_SECONDS:-120}" "$ferry" bench-engine \
        --serving --device cuda --gpu-mode fast "${model[@]}" --batch "${KNOBS_BATCH:-64,96,128}" \
        --prompt-len "${ENGINE_PROMPT_LEN:-1024}" --decode-steps "${KNOBS_DECODE_STEPS:-512}" --repeat 1 2>&1 \
        | grep '^|' | tee -a "$md" || echo "lease: knobs: $arm did not finish" | tee -a "$md"
    done
  done
}

stage_rounds() {
  # What a speculating engine's steps cost on the lease pair's shape without training it
  # (models/dummy/dspark-h200 + dspark-h200-drafter, seeded random weights: drafts are never
  # accepted, so the speed-up means nothing; the engine step counters — a round's drafter pass,
  # launch, verify wait and commit next to a plain step — are real). ROUNDS_VERIFY_LEN (fixed:8)
  # drafts a whole block every step.
  local ferry
  ferry=$(gpu_stage_ferry rounds "it measures the CUDA engine") || return 0
  set +u; source scripts/gpu_env.sh; set -u
  mkdir -p "$RUN/bench"
  timeout "${ROUNDS_SECONDS:-240}" "$ferry" bench-engine --speculative --load-format dummy \
    --model models/dummy/dspark-h200 --drafter models/dummy/dspark-h200-drafter --device cuda \
    --gpu-mode fast --batch "${ROUNDS_BATCH:-1,16,64,128}" --prompt-len "${ENGINE_PROMPT_LEN:-1024}" \
    --decode-steps "${ROUNDS_DECODE_STEPS:-256}" --verify-len "${ROUNDS_VERIFY_LEN:-fixed:8}" \
    --json "$RUN/bench/rounds.json" 2>&1 | grep '^|' | tee "$RUN/bench/rounds.md" \
    || echo "lease: rounds did not finish" | tee -a "$RUN/bench/rounds.md"
  "$PY" - "$RUN/bench/rounds.json" <<'PY' | tee -a "$RUN/bench/rounds.md" || true
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    e = r["engine_steps"]; p = e["plain"]["decode"]; q = e["spec"]["spec_round"]
    ph = " / ".join(f"{q[k]:.3f}" for k in ("plan_ms", "launch_ms", "sample_ms", "commit_ms"))
    print(f"rounds: c = {r['concurrency']}: plain step {p['ms']:.3f} ms; round {q['ms']:.3f} ms "
          f"(plan / launch / sample / commit {ph}), {q['decode_rows_per_step']:.1f} rows")
PY
}

stage_verifycost() {
  local ferry tau=() ks="1,2,3,4,5,7,9,11,13,15"
  ferry=$(gpu_stage_ferry verifycost "it measures the V2-Lite-shaped model on a GPU") || return 0
  set +u; source scripts/gpu_env.sh; set -u
  # The trained pair's held-out τ for every k up to its block B: from the conditional acceptance
  # per position c_j (train_drafter.py's greedy evaluation; the serving-shaped test when the
  # report has one), τ(k) = 1 + Σ_{j<k} Π_{i≤j} c_i.
  if [ -f "$RUN/drafter/train_report.json" ]; then
    local pairs
    pairs=$("$PY" -c 'import json,sys
r = json.load(open(sys.argv[1]))
ev = (r.get("serving_shaped") or {}).get("test_after") or r["test_after"]
c = ev["conditional_acceptance_per_position"]
tau, reach, out = 1.0, 1.0, []
for k, ck in enumerate(c, 1):
    reach *= ck; tau += reach; out.append(f"{k}:{min(tau, k + 1):.3f}")
print(",".join(out))' "$RUN/drafter/train_report.json" 2>/dev/null || echo "")
    if [ -n "$pairs" ]; then
      tau=(--tau "$pairs")
      local b=${pairs##*,}; b=${b%%:*}
      case ",$ks," in *",$b,"*) ;; *) ks="$ks,$b" ;; esac
    fi
  fi
  mkdir -p "$RUN/bench"
  "$ferry" bench-engine --verify-cost --device cuda --gpu-mode fast --load-format dummy \
    --model models/dummy/deepseek-v2-lite --drafter-config models/dummy/v2-lite-drafter/config.json \
    --batch "${VERIFY_BATCH:-1,4,16,64}" --prompt-len 1024 --verify-k "$ks" "${tau[@]}" \
    --json "$RUN/bench/verify_cost.json" 2>&1 | tee "$RUN/bench/verify_cost.md"
  # The drafter pass for sampled requests (its distributions built and drawn at each block
  # position), at the temperatures of VERIFY_TEMPS (one verify length: the pass is the point).
  for t in ${VERIFY_TEMPS-0.7}; do
    "$ferry" bench-engine --verify-cost --device cuda --gpu-mode fast --load-format dummy \
      --model models/dummy/deepseek-v2-lite --drafter-config models/dummy/v2-lite-drafter/config.json \
      --batch "${VERIFY_TEMP_BATCH:-1,16}" --prompt-len 1024 --verify-k 1 --temperature "$t" \
      --json "$RUN/bench/verify_cost_t$t.json" 2>&1 | tee "$RUN/bench/verify_cost_t$t.md"
  done
}

stage_cpu() {
  # Issue 15's "CPU figures re-measured with the new pair": the GPU machine's own CPU cores (the
  # weights exist only in this lease), plain against speculative in one command per policy.
  local ferry
  ferry=$(ferry_bin)
  if [ -z "$ferry" ]; then echo "lease: cpu skipped: no ferry binary"; return; fi
  mkdir -p "$RUN/bench"
  : > "$RUN/bench/cpu_spec.md"
  # Greedy identity on the CPU backend for the trained pair (the GPU's is the `check` stage).
  local prompt
  prompt=$("$PY" -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["prompt"][-400:])' \
    "$RUN/prompts-$PROMPT_TOKENS.jsonl" 2>/dev/null || echo "def main():")
  if "$ferry" generate --device cpu --model "$RUN/target" --prompt "$prompt" --max-tokens 48 \
       --speculative off > "$RUN/logs/cpu_plain.txt" 2>/dev/null \
     && "$ferry" generate --device cpu --model "$RUN/target" --drafter "$RUN/drafter" --speculative on \
       --prompt "$prompt" --max-tokens 48 > "$RUN/logs/cpu_spec.txt" 2>/dev/null; then
    if cmp -s "$RUN/logs/cpu_plain.txt" "$RUN/logs/cpu_spec.txt"; then
      echo "lease: cpu: greedy plain == speculative on the CPU (48 tokens)" | tee -a "$RUN/bench/cpu_spec.md"
    else
      echo "lease: cpu: greedy plain != speculative on the CPU (see $RUN/logs/cpu_*.txt)" | tee -a "$RUN/bench/cpu_spec.md"
    fi
    if [ -f "$RUN/logs/check_plain.txt" ]; then
      if cmp -s "$RUN/logs/cpu_plain.txt" "$RUN/logs/check_plain.txt"; then
        echo "lease: cpu: the CPU's greedy text == the GPU's (check stage)" | tee -a "$RUN/bench/cpu_spec.md"
      else
        echo "lease: cpu: the CPU's greedy text != the GPU's (fast mode's bf16 against f32: informational)" \
          | tee -a "$RUN/bench/cpu_spec.md"
      fi
    fi
  else
    echo "lease: cpu: ferry generate --device cpu failed" | tee -a "$RUN/bench/cpu_spec.md"
  fi
  local v parts=()
  for v in ${CPU_VERIFY_LENS:-goodput confidence:0.3}; do
    local f="$RUN/bench/.cpu_spec_${v%%:*}.json"
    echo "lease: cpu: ferry bench-engine --speculative --device cpu --verify-len $v" | tee -a "$RUN/bench/cpu_spec.md"
    timeout "${CPU_SECONDS:-80}" "$ferry" bench-engine --speculative --device cpu --model "$RUN/target" \
      --drafter "$RUN/drafter" --batch "${CPU_BATCH:-1,4}" --prompt-len "${CPU_PROMPT_LEN:-512}" \
      --prompts "$RUN/prompts-$PROMPT_TOKENS.jsonl" \
      --decode-steps "${CPU_DECODE_STEPS:-64}" --repeat 1 --verify-len "$v" --json "$f" 2>&1 \
      | grep '^|' | tee -a "$RUN/bench/cpu_spec.md" || echo "lease: cpu: $v did not finish"
    [ -f "$f" ] && parts+=("$v=$f")
  done
  "$PY" - "$RUN/bench/cpu_spec.json" "$(nproc)" "${parts[@]}" <<'EOF2'
import json, sys
out = {"benchmark": "bench-engine --speculative --device cpu, the lease's trained pair", "cpu_cores": int(sys.argv[2]),
       "policies": {}}
for arg in sys.argv[3:]:
    v, f = arg.split("=", 1)
    out["policies"][v] = json.load(open(f))
json.dump(out, open(sys.argv[1], "w"), indent=1)
EOF2
}

stage_summary() {
  "$PY" - "$RUN" <<'EOF'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
t = run / "target" / "train_report.json"
if t.exists():
    r = json.loads(t.read_text())
    p = r["parameters"]
    print(f"summary: target {r['preset']} on {r['device']}: {p['total']/1e6:.1f}M parameters "
          f"({p['active']/1e6:.1f}M active), {r['bf16_bytes']/1e6:.0f} MB bf16; "
          f"{r['tokens_seen']:,} tokens = {r['epochs']:.3f} epochs in {r['train_seconds']:.0f}s "
          f"({r['tokens_per_second']:,} tok/s, stopped by {r['schedule']['stopped_by']}); "
          f"loss train {r['final']['train_loss_on_seen_windows']:.3f} / held-out "
          f"{r['final']['heldout_loss']:.3f}; experts {r['experts_implementation']}")
    for s in r.get("samples", [])[:1]:
        print(f"summary: sample {s['prompt'][-60:]!r} -> {s['greedy'][:120]!r}")
d = run / "drafter" / "train_report.json"
if d.exists():
    r = json.loads(d.read_text())
    a = r["test_after"]
    cfg = json.loads((run / "drafter" / "config.json").read_text())
    print(f"summary: drafter block {cfg['block_size']}, {cfg['num_hidden_layers']} layers, taps "
          f"{cfg['target_layer_ids']}: held-out acceptance length {a['acceptance_length_fixed_B']:.3f} "
          f"(gamma = B), {a['confidence_0.3_acceptance_length']:.3f} under confidence:0.3; match per "
          f"position {a['match_rate_per_position']}; {r['total_seconds']:.0f}s")
    for part, regions in (r.get("test_after_by_part") or {}).items():
        for region, e in regions.items():
            if e is None:
                continue
            print(f"summary: drafter test, {part} data, {region} region: acceptance length "
                  f"{e['acceptance_length_fixed_B']:.3f} (gamma = B), "
                  f"{e['confidence_0.3_acceptance_length']:.3f} under confidence:0.3; conditional "
                  f"{e['conditional_acceptance_per_position']} ({e['blocks']} blocks)")
    s = (r.get("serving_shaped") or {}).get("test_after")
    if s:
        print(f"summary: drafter serving-shaped held-out τ (prompt {r['serving_shaped']['prompt_lens']} "
              f"+ greedy tail to {r['serving_shaped']['seq_len']}): {s['acceptance_length_fixed_B']:.3f} "
              f"at gamma = B; data {r['data_seconds']:.0f}s, {r['steps_run']} steps, device memory "
              f"peak {(r.get('device_memory_peak_gb') or {}).get('all')} GB")
for f in sorted((run / "logs").glob("check_*.txt")):
    print(f"summary: {f.name}: {f.read_text()[:100]!r}")
rp = run / "logs" / "replay.json"
if rp.exists():
    r = json.loads(rp.read_text())
    f = r.get("ferry", {})
    print(f"summary: replay (fixed:8, 128 tokens): reference tau {r['tau']} over {r['rounds']} rounds; "
          f"ferry accepted {f.get('accepted')} vs {r['accepted']}, {f.get('rounds_differing')} rounds differ "
          f"({f.get('of_them_near_ties')} at near-ties)")
v = run / "bench" / "verify_cost.json"
if v.exists():
    for row in json.loads(v.read_text())["rows"]:
        if row.get("computed_speedup"):
            print(f"summary: verify cost (V2-Lite shape, batch {row['batch']}, k {row['k']}): verify/step "
                  f"{row['verify_over_step']:.2f}, draft {row['draft_pass_ms']:.2f} ms; computed speed-up at "
                  f"tau {row['tau']}: {row['computed_speedup']:.2f}x")
b = run / "bench" / "dspark_bench.json"
if b.exists():
    r = json.loads(b.read_text())
    for arm, a in r["arms"].items():
        if a.get("error"):
            print(f"summary: bench: {arm} arm failed: {a['error']}")
    # Whether the load generator, not ferry, set a level's rate (session 52): its own ceiling,
    # and the lowest share of client time inside requests of each arm.
    cc = r.get("client_ceiling") or {}
    low, busy = {}, {}
    for arm, a in r["arms"].items():
        levels = [lv for res in a["results"].values() for lv in res]
        shares = [(lv["in_request_share"], lv["concurrency"]) for lv in levels
                  if lv.get("in_request_share") is not None]
        if shares:
            low[arm] = min(shares)
        # The host's busiest level (its whole CPU, and the router's cores there).
        host = [(lv["machine_busy_share"], lv["concurrency"], (lv.get("cpu_cores") or {}).get("router"))
                for lv in levels if lv.get("machine_busy_share") is not None]
        if host:
            busy[arm] = max(host)
    print(f"summary: bench load generator: ceiling {cc.get('tok_s')} tok/s by processes at c={cc.get('concurrency')}; "
          "lowest share in a request " + ", ".join(f"{arm} {s} (c{c})" for arm, (s, c) in low.items())
          + " (below ~0.9: the client set that level's rate)")
    # How much of the prompts the prefix cache served (session 54: the lease's 256 prompts,
    # reused and cached by the warm-up, made every earlier greedy level decode-only).
    shares = {arm: [(lv["prompt_cached_share"], lv["concurrency"])
                    for res in a["results"].values() for lv in res
                    if lv.get("prompt_cached_share") is not None]
              for arm, a in r["arms"].items()}
    cached = {arm: max(s) for arm, s in shares.items() if s}
    if cached:
        print("summary: bench prompts from the prefix cache: most " + ", ".join(
            f"{arm} {sh} (c{c})" for arm, (sh, c) in cached.items())
            + " (near 0: every prompt prefilled; near 1: the level measured decoding alone)")
    if busy:
        print("summary: bench host CPU: busiest level " + ", ".join(
            f"{arm} {b} of the machine, router {rc} cores (c{c})" for arm, (b, c, rc) in busy.items())
            + " (near 1: the host CPU may have set that level's rate)")
    for t, sp in r.get("speedup", {}).items():
        lv = " ".join(f"c{x['concurrency']}:{x['aggregate']}x" for x in sp["per_level"])
        print(f"summary: bench T={t}: spec/plain aggregate {lv}; peak {sp['spec_peak_aggregate_tok_s']} vs "
              f"{sp['plain_peak_aggregate_tok_s']} tok/s = {sp['peak_aggregate_ratio']}x")
    for t, sp in r.get("confidence_vs_fixed", {}).items():
        if not sp["per_level"]:
            continue
        lv = " ".join(f"c{x['concurrency']}:{x['aggregate']}x" for x in sp["per_level"])
        print(f"summary: bench T={t}: spec arm / fixed verify length, aggregate {lv}")
# What `goodput` chose, by running sequences, from the spec arms' debug lines (the lease's
# FERRY_LOG=…goodput=debug; session 54 read them by hand to see it verify whole blocks at
# c = 128 where fixed:4 served more): the share of each choice per batch-size band, over the
# steps that drafted (a step it decided not to draft for prints no line; the bench table's
# plain steps against rounds count those). A step that explored (`goodput explores`, session
# 57) counts as Explore(the unknown cost), "+prompts" when prompt work was beside it; a width
# picked before drafting (`queued=true`, FERRY_GOODPUT_QUEUED=1, session 58) as "<choice>q".
# One line for the `spec` arm and, when it ran, one for `spec_env`.
import collections, re
ansi = re.compile(r"\x1b\[[0-9;]*m")
bands = ((1, 1), (2, 63), (64, 127), (128, 191), (192, 255), (256, 1 << 30))
for arm in ("spec", "spec_env"):
    g = run / "bench" / "logs" / f"ferry_up_{arm}.log"
    if not g.exists():
        continue
    seen = collections.defaultdict(collections.Counter)
    with open(g, errors="replace") as fh:
        for line in fh:
            if "goodput choice" in line:
                line = ansi.sub("", line)
                ch = re.search(r"\bchoice=(\S+)", line)
                choice = ch.group(1) if ch else None
                if choice and "queued=true" in line:
                    choice += "q"
            elif "goodput explores" in line:
                line = ansi.sub("", line)
                u = re.search(r'\bunknown="?([^"=]*?)"?(?: \w+=|\s*$)', line)
                beside = "+prompts" if "beside_prompts=true" in line else ""
                choice = f"Explore({u.group(1).strip() if u else '?'}{beside})"
            else:
                continue
            m = re.search(r"\bseqs=(\d+)", line)
            if m and choice:
                n = int(m.group(1))
                band = next((b for b in bands if b[0] <= n <= b[1]), None)
                if band:
                    seen[band][choice] += 1
    if seen:
        parts = []
        for band in bands:
            cnt = seen.get(band)
            if not cnt:
                continue
            total = sum(cnt.values())
            label = str(band[0]) if band[0] == band[1] else (f"{band[0]}+" if band[1] > 4096 else f"{band[0]}-{band[1]}")
            parts.append(f"{label}: " + " ".join(f"{k} {v / total:.0%}" for k, v in cnt.most_common(4)) + f" ({total})")
        print(f"summary: goodput choices ({arm}) by running sequences: " + "; ".join(parts))
c = run / "bench" / "cpu_spec.json"
if c.exists():
    r = json.loads(c.read_text())
    for v, p in r.get("policies", {}).items():
        lv = " ".join(f"c{x['concurrency']}:{x['spec_tok_s'] / x['plain_tok_s']:.2f}x (tau {x['acceptance_length']:.2f})"
                      for x in p.get("rows", []) if x.get("plain_tok_s"))
        print(f"summary: cpu ({r['cpu_cores']} cores) {v}: spec/plain {lv}")
e = run / "bench" / "engine_spec.json"
if e.exists():
    for v, p in json.loads(e.read_text()).get("policies", {}).items():
        for x in p.get("rows", []):
            if not x.get("plain_tok_s"):
                continue
            print(f"summary: engine on cuda {v} c{x['concurrency']}: spec/plain "
                  f"{x['spec_tok_s'] / x['plain_tok_s']:.2f}x ({x['spec_tok_s']:.0f} vs {x['plain_tok_s']:.0f} tok/s), "
                  f"tau {x['acceptance_length']:.2f}, {x['drafts_per_round']:.2f} drafts/round; draft "
                  f"{x['draft_pass_ms']:.3f} ms, verify {x['verify_pass_ms']:.3f} ms, decode step {x['decode_step_ms']:.3f} ms")
            if x.get("plain_steady_tok_s"):
                print(f"summary: engine on cuda {v} c{x['concurrency']}: steady (all c in flight) spec/plain "
                      f"{x['spec_steady_tok_s'] / x['plain_steady_tok_s']:.2f}x "
                      f"({x['spec_steady_tok_s']:.0f} vs {x['plain_steady_tok_s']:.0f} tok/s)")
            for key, what in (("spec_by_prediction", "rounds"), ("spec_skipped_by_prediction", "skipped rounds")):
                bins = [b for b in x.get(key) or [] if b.get("rounds")]
                if bins:
                    print(f"summary: engine on cuda {v} c{x['concurrency']}: {what} by the head's prediction "
                          + "; ".join(f"[{b['from']}, {b['below'] if b['below'] is not None else 'inf'}): "
                                      f"{b['rounds']} rounds, predicted {b['predicted_mean']:.2f}, accepted {b['accepted_mean']:.2f}"
                                      for b in bins))
            widths = x.get("spec_rounds_by_width") or []
            if any(widths):
                print(f"summary: engine on cuda {v} c{x['concurrency']}: rounds by drafts verified "
                      + ", ".join(f"{g}: {n}" for g, n in enumerate(widths) if n))
            es = x.get("engine_steps") or {}
            for arm in ("plain", "spec"):
                for kind, k in (es.get(arm) or {}).items():
                    if k.get("steps"):
                        ph = " / ".join(f"{k.get(p + '_ms') or 0:.3f}" for p in ("plan", "launch", "sample", "commit"))
                        print(f"summary: engine on cuda {v} c{x['concurrency']} {arm} {kind}: {k['steps']} steps x "
                              f"{k['ms']:.3f} ms (plan / launch / sample / commit {ph})")
EOF
}

copy_out() {
  [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ] || return 0
  # At most 8 files come back from a device command: every JSON report travels in one file
  # (bench reports under "bench/NAME"), the markdown tables (≤ 4) next to it, and the benchmark
  # clusters' logs in one archive.
  cp "$RUN/lease.log" "$OUT/" 2>/dev/null || true
  "$PY" - "$RUN" "$OUT/lease_reports.json" <<'EOF2' 2>/dev/null || true
import json, sys
from pathlib import Path
run, out = Path(sys.argv[1]), {}
for key, f in (("target_config", "target/config.json"), ("target_train_report", "target/train_report.json"),
               ("drafter_config", "drafter/config.json"), ("drafter_train_report", "drafter/train_report.json"),
               ("replay", "logs/replay.json")):
    p = run / f
    if p.exists():
        out[key] = json.loads(p.read_text())
for p in sorted((run / "bench").glob("*.json")):
    out[f"bench/{p.name}"] = json.loads(p.read_text())
Path(sys.argv[2]).write_text(json.dumps(out, indent=1) + "\n")
EOF2
  mkdir -p "$OUT/bench"
  cp "$RUN"/bench/*.md "$OUT/bench/" 2>/dev/null || true
  # `ferry up`'s logs of every arm and repeat (with FERRY_LOG's debug lines, e.g. each
  # `goodput choice`): 13 MB of them came to 1.8 MB in session 52.
  (cd "$RUN/bench" 2>/dev/null && ls -d logs repeat*/logs 2>/dev/null | xargs -r tar cJf "$OUT/bench/logs.tar.xz") 2>/dev/null || true
}

stage_wait() {
  local pid
  pid=$(cat "$RUN/lease.pid" 2>/dev/null || echo "")
  [ -n "$pid" ] || { echo "lease: nothing started ($RUN/lease.pid missing)"; exit 2; }
  # Quiet on purpose: the machine is given back 30 s after a command ends, so the next `wait`
  # must follow at once; a short answer is read fast. The whole log comes back as lease.log.
  if kill -0 "$pid" 2>/dev/null; then
    timeout "$WAIT_SECONDS" tail --pid="$pid" -f /dev/null || true
  fi
  grep '^lease: ===' "$RUN/lease.log" | tail -n 12
  tail -n "${WAIT_TAIL_LINES:-4}" "$RUN/lease.log" | cut -c1-240
  if kill -0 "$pid" 2>/dev/null; then
    echo "lease: still running (pid $pid): call 'scripts/dspark_lease.sh wait' again"
  else
    echo "lease: finished: $(tail -1 "$RUN/lease.status" 2>/dev/null || echo '?')"
    stage_summary
  fi
  copy_out
}

run_stage() {
  local s=$1 t0=$SECONDS
  echo "lease: === $s ($(date -u +%H:%M:%S)) ==="
  "stage_$s"
  echo "lease: === $s done in $((SECONDS - t0))s ==="
}

[ $# -ge 1 ] || { sed -n 2,40p "$0"; exit 2; }
for stage in "$@"; do
  case "$stage" in
    target|drafter|prompts|check|bench|engine|knobs|rounds|verifycost|cpu|summary) run_stage "$stage" ;;
    all)
      for s in target drafter prompts check bench engine cpu verifycost summary; do run_stage "$s"; done ;;
    start)
      if [ -f "$RUN/lease.pid" ] && kill -0 "$(cat "$RUN/lease.pid")" 2>/dev/null; then
        echo "lease: a run is going on already (pid $(cat "$RUN/lease.pid")): following it"
        stage_wait; continue
      fi
      : > "$RUN/lease.log"; rm -f "$RUN/lease.status"
      setsid nohup bash -c "bash '$0' ${LEASE_STAGES:-all}; echo \"exit \$? at \$(date -u +%H:%M:%S)\" > '$RUN/lease.status'" \
        >> "$RUN/lease.log" 2>&1 < /dev/null &
      echo $! > "$RUN/lease.pid"
      echo "lease: started (pid $!), log $RUN/lease.log"
      sleep 2
      stage_wait ;;
    wait) stage_wait ;;
    smoke)
      PRESET=tiny CORPUS=$CORPUS RUN=$RUN DEVICE=${DEVICE:-cpu} bash "$0" target drafter prompts check \
        $([ -n "${FERRY:-}" ] && echo bench) summary ;;
    *) echo "lease: unknown stage $stage"; exit 2 ;;
  esac
done
