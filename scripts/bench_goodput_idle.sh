#!/usr/bin/env bash
# What a speculating engine costs when `goodput` has switched speculation off (issue 15's "does
# not hurt at high load"; session 54's lease: at c = 256 `goodput` ran 2,663 plain steps and 94
# rounds, and lost 7-9 % to plain because its plain steps cost 5 % more, 0.36 against 0.20 ms of
# host launch, and its prompt steps 10 % more).
#
# `ferry bench-engine --speculative` runs a plain engine and a `goodput` engine in one command on
# the same prompts. With `--load-format dummy` the drafter's weights are random, so its drafts
# are never accepted and `goodput` stops drafting after its first rounds: the spec engine then
# does what a loaded one does past the crossover (plain steps, the drafter context kept up for
# later, prompts admitted every few steps), and its steps against the plain engine's are the
# overhead. No training needed: ~2 minutes of device time at the defaults.
#
#   [LEVEL=256] [PROMPT_LEN=1024] [DECODE_STEPS=400] [WAVES=3] [DEVICE=cuda] \
#     OUT=... bash scripts/bench_goodput_idle.sh
#
# Prints, per step kind (decode, prompt, spec round), steps and mean ms by phase for both
# engines, and writes $OUT/goodput_idle.json (bench-engine's report).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-logs}"
mkdir -p "$out"
device=${DEVICE:-cuda}
if [ "$device" != cpu ]; then
  # cudarc loads libnvrtc / libcublas at run time (docs/gpu.md); gpu_env.sh is not `set -u` clean.
  set +u
  # shellcheck disable=SC1091
  source scripts/gpu_env.sh >/dev/null
  set -u
fi
ferry=${FERRY:-./device-bin/ferry}
level=${LEVEL:-256}
json="$out/goodput_idle.json"
timeout "${RUN_TIMEOUT:-300}" "$ferry" bench-engine --speculative --load-format dummy \
  --model models/dummy/dspark-h200 --drafter models/dummy/dspark-h200-drafter --device "$device" \
  --gpu-mode fast --batch "$level" --prompt-len "${PROMPT_LEN:-1024}" \
  --decode-steps "${DECODE_STEPS:-400}" --requests "$((level * ${WAVES:-3}))" --waves "${WAVES:-3}" \
  --verify-len goodput --temperature 0 --json "$json" >"$out/goodput_idle.log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  echo "bench_goodput_idle: bench-engine exited $rc; tail of $out/goodput_idle.log:"
  tail -20 "$out/goodput_idle.log"
  exit $rc
fi
python3 - "$json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["rows"][0]
steps = r["engine_steps"]
print(f"bench_goodput_idle: c = {r['concurrency']}, {r['requests']} requests: plain {r['plain_tok_s']:.0f} tok/s, "
      f"goodput {r['spec_tok_s']:.0f} tok/s ({r['spec_tok_s'] / r['plain_tok_s']:.3f}x); "
      f"{steps['spec']['spec_round']['steps']} rounds, {steps['spec']['decode']['steps']} plain steps")
fmt = lambda v: "-" if v is None else f"{v:.3f}"
for kind in ("decode", "prompt", "spec_round"):
    for eng in ("plain", "spec"):
        s = steps[eng][kind]
        if not s["steps"]:
            continue
        print(f"  {kind:10s} {eng:5s} {s['steps']:6d} steps, {fmt(s['ms'])} ms = plan {fmt(s['plan_ms'])} + "
              f"launch {fmt(s['launch_ms'])} + sample {fmt(s['sample_ms'])} + commit {fmt(s['commit_ms'])}; "
              f"{fmt(s['sequences_per_step'])} sequences a step, {s.get('graphed_steps', 0)} graphed")
PY
