#!/usr/bin/env bash
# Runs on the GPU machine (docs/gpu.md): where a loaded speculative benchmark's GPU time goes,
# by kernel, from one Nsight Systems trace of `ferry bench-engine --speculative` on the DSpark
# lease pair's shape with seeded random weights (the rounds workload of
# scripts/bench_binary_ab.sh at one level: plain steps, speculating rounds, and the steps that
# carry prompts, in one process). Writes $OUT/kernels.csv (nsys's cuda_gpu_kern_sum) and
# prints the kernels by total time, then the families' shares (kernel name prefixes).
#   FERRY=device-bin/ferry LEVEL=128 OUT=$OUT bash scripts/profile_rounds.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-logs}"
mkdir -p "$out"
ferry="${FERRY:-device-bin/ferry}"
nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
if [ -z "$nsys" ]; then
  echo "profile_rounds: no nsys on this machine"
  exit 2
fi
# shellcheck disable=SC1091
source scripts/gpu_env.sh >/dev/null
timeout "${RUN_TIMEOUT:-240}" "$nsys" profile --trace=cuda --sample=none --cpuctxsw=none \
  --force-overwrite=true -o "$out/rounds" \
  "$ferry" bench-engine --speculative --load-format dummy --model models/dummy/dspark-h200 \
  --drafter models/dummy/dspark-h200-drafter --device cuda --gpu-mode fast \
  --batch "${LEVEL:-128}" --prompt-len 1024 --decode-steps "${STEPS:-128}" --waves 2 \
  --warmup-tokens 16 --verify-len "${VERIFY_LEN:-fixed:4}" --max-batch-tokens 2048 --repeat 1 \
  --json "$out/bench.json" >"$out/bench.log" 2>&1
echo "nsys rc=$?"
"$nsys" stats --report cuda_gpu_kern_sum --format csv --output "$out/kernels" "$out/rounds.nsys-rep" \
  >/dev/null 2>&1
csv=$(ls "$out"/kernels*.csv 2>/dev/null | head -1)
rm -f "$out/rounds.nsys-rep" "$out/rounds.sqlite"
[ -n "$csv" ] || { echo "profile_rounds: no kernel summary"; exit 1; }
python3 - "$csv" <<'PY'
import csv, sys, collections
rows = list(csv.DictReader(open(sys.argv[1])))
def col(r, *names):
    for n in names:
        for k in r:
            if k.strip().lower().startswith(n):
                return r[k]
total = sum(float(col(r, "total time")) for r in rows)
print(f"GPU kernel time {total/1e6:.1f} ms in {len(rows)} kernels")
print("| kernel | calls | total ms | share | avg µs |")
print("|---|---|---|---|---|")
fam = collections.Counter()
for r in rows:
    t = float(col(r, "total time")); n = int(col(r, "instances")); name = col(r, "name")
    short = name.split("(")[0].split("<")[0]
    fam[short.split("_")[0] if not short.startswith(("sm", "cutlass", "void", "nvjet", "gemm", "gemv")) else "cublas"] += t
for r in sorted(rows, key=lambda r: -float(col(r, "total time")))[:45]:
    t = float(col(r, "total time")); n = int(col(r, "instances")); name = col(r, "name")[:70]
    print(f"| {name} | {n} | {t/1e6:.2f} | {100*t/total:.1f} % | {t/n/1e3:.1f} |")
print("\n| family | total ms | share |\n|---|---|---|")
for f, t in fam.most_common():
    print(f"| {f} | {t/1e6:.2f} | {100*t/total:.1f} % |")
PY
grep -E "tok/s|steady" "$out/bench.log" | tail -6
