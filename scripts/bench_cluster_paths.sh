#!/usr/bin/env bash
# The cluster's KV paths on a GPU, with seeded random weights of a model's shape (no training):
# runs issue 15's benchmark hook (scripts/dspark_bench.sh) with `--load-format dummy`.
#
#   MODE=land  (default) arm ARM (plain; spec: with the dummy drafter, whose context ships and
#              lands whatever it accepts) once per value of ORDER (default "0 1 0 1") of
#              FERRY_DIRECT_KV_WRITES: a decode worker's peer runs written through its engine
#              thread (0), the target's layers from the receiving thread (1, the default), or
#              the drafter's too (all); one line per level. AB_VAR names another variable
#              to alternate instead (e.g. AB_VAR=FERRY_PROMPT_STEPS ORDER="mixed auto mixed
#              auto" ARM=spec_fixed: a speculating arm whose rounds always run, at fixed:4).
#   MODE=ship  the speculating arm (dummy drafter: acceptance means nothing, the paths' costs
#              do) with FERRY_LOG=ferry_model::engine::spec=debug; the mean read / encode / sink
#              time of the prefill worker's drafter shipping per prompt.
#
#   TARGET_DIR=train-out/target DRAFTER_DIR=train-out/drafter bash scripts/bench_cluster_paths.sh
#
# TARGET_DIR needs config.json and the tokenizer (the lease's trained target, or any model
# directory); DRAFTER_DIR a DSpark drafter's config.json. PROMPTS: held-out prompts (JSON lines
# with `ids`); unset, 256 seeded random 1,024-token prompts are written under $OUT.
# CONC (64,128 for land, 1,64 for ship), SECS (90 per run), FERRY (device-bin/ferry), DEVICE
# (cuda; cpu for a dry run of the script on the embedded model, models/tiny-k3 and -dspark),
# OUT (bench-paths). Output: one line per level and the hook's JSON / markdown under $OUT/run_*.
set -u
cd "$(dirname "$0")/.."
MODE=${MODE:-land}
OUT=${OUT:-bench-paths}
: "${TARGET_DIR:?TARGET_DIR: a model directory (config.json and tokenizer)}"
: "${DRAFTER_DIR:?DRAFTER_DIR: a DSpark drafter directory (config.json)}"
export TARGET_DIR DRAFTER_DIR FERRY=${FERRY:-device-bin/ferry}
mkdir -p "$OUT"
if [ -z "${PROMPTS:-}" ]; then
  PROMPTS=$OUT/random-prompts-1024.jsonl
  python3 - "$TARGET_DIR/config.json" "$PROMPTS" <<'PY'
import json, random, sys
vocab = json.load(open(sys.argv[1]))["vocab_size"]
rng = random.Random(7)
with open(sys.argv[2], "w") as f:
    for _ in range(256):
        f.write(json.dumps({"ids": [rng.randrange(3, vocab - 1) for _ in range(1024)]}) + "\n")
PY
fi
export PROMPTS BENCH_TEMPERATURES=0 BENCH_SECONDS=${SECS:-90} BENCH_WARMUP_TOKENS=16
export BENCH_UP_ARGS="--load-format dummy ${BENCH_UP_ARGS:-}"

summary() { # $1: the run directory, $2: the arm
  python3 - "$1/bench/dspark_bench.json" "$2" <<'PY'
import json, sys
b = json.load(open(sys.argv[1]))
for l in b["arms"][sys.argv[2]]["results"]["0"]:
    steps = [s for s in l["engine_steps"].values() if s.get("steps")]
    n = sum(s["steps"] for s in steps)
    ms = sum(s["steps"] * s["mean_ms"] for s in steps) / max(n, 1)
    print(f"  c={l['concurrency']}: {l['aggregate_tok_s']:.0f} tok/s (steady {l['steady_tok_s']:.0f}), "
          f"TTFT p50 {l['ttft_ms_p50']:.0f} ms, decode busy {l['decode_busy_share']:.2f}, "
          f"{ms:.2f} ms / decode-worker step, prefills {l['prefills']}")
PY
}

case "$MODE" in
land)
  ARM=${ARM:-plain}
  AB_VAR=${AB_VAR:-FERRY_DIRECT_KV_WRITES}
  export BENCH_ARMS=$ARM BENCH_CONCURRENCY=${CONC:-64,128}
  # The spec_fixed arm at the same levels, at fixed:4 (the hook's own default is the block).
  export BENCH_FIXED_CONCURRENCY=${CONC:-64,128} BENCH_FIXED_VERIFY_LEN=${BENCH_FIXED_VERIFY_LEN:-fixed:4}
  n=0
  for value in ${ORDER:-0 1 0 1}; do
    n=$((n + 1))
    run=$OUT/run_${n}_$value
    env "$AB_VAR=$value" RUN="$run" bash scripts/dspark_bench.sh >"$OUT/run_$n.log" 2>&1
    echo "$AB_VAR=$value (exit $?):"
    summary "$run" "$ARM"
  done
  ;;
ship)
  export BENCH_ARMS=spec BENCH_CONCURRENCY=${CONC:-1,64}
  export FERRY_LOG="warn,ferry=info,ferry_model::engine::spec=debug"
  run=$OUT/run_ship
  RUN=$run bash scripts/dspark_bench.sh >"$OUT/run_ship.log" 2>&1
  echo "drafter shipping (exit $?):"
  summary "$run" spec
  python3 - "$run/bench/logs" <<'PY'
import os, re, sys
keys = ("read_ms", "encode_ms", "sink_ms", "total_ms")
seen = []
for name in os.listdir(sys.argv[1]):
    for line in open(os.path.join(sys.argv[1], name), errors="replace"):
        if "drafter context shipped" in line:
            fields = dict(re.findall(r"(\w+)=([0-9.]+)", re.sub(r"\x1b\[[0-9;]*m", "", line)))
            seen.append((float(fields.get("blocks", 0)), [float(fields.get(k, 0)) for k in keys]))
if seen:
    n = len(seen)
    means = [sum(v[i] for _, v in seen) / n for i in range(len(keys))]
    print(f"  {n} prompts of {sum(b for b, _ in seen) / n:.0f} blocks: "
          + ", ".join(f"{k} {m:.3f}" for k, m in zip(keys, means)))
else:
    print("  no shipping logged (no drafter, or FERRY_LOG not honoured)")
PY
  rm -rf "$run/bench/logs"
  ;;
*)
  echo "MODE is land or ship, got $MODE"
  exit 2
  ;;
esac
