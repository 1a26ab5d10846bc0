#!/usr/bin/env bash
# Issue 18's run: disaggregated serving across two GPUs (prefill on one, decode on the other,
# KV over UCX `cuda_ipc`) measured against aggregated serving on the same two GPUs. Stages are
# sized to fit one 10-minute device command each; results go to $OUT (JSON per stage, and
# summary.md), logs to $OUT/logs.
#
#   scripts/two_gpu_run.sh STAGE...
#
# Stages:
#   topo      nvidia-smi -L and `nvidia-smi topo -m`: how the GPUs are linked    -> topo.txt
#   transfer  bench_transfer_gpu --gpus P,D: UCX puts from GPU P's memory into another process's
#             memory on GPU D, next to a peer-to-peer copy of the same bytes       -> transfer.json
#   tail      the decode worker's wait after the prefill forward ends (bench_kv_tail.sh) at
#             TAIL_TOKENS (8192, 32768), prefill on P and decode on D          -> tail-<tokens>.json
#   serve     ferry bench, PROMPT in / OUTPUT out at LEVELS: disaggregated (1 prefill worker on
#             P + 1 decode worker on D, KV over $TRANSPORT) and aggregated (2 decode workers,
#             one per GPU, the router balancing them)          -> serve-{disaggregated,aggregated}.json
#   mix       as serve with every LONG_EVERY-th prompt LONG tokens long, at MIX_LEVELS; the short
#             requests' TTFT and ITL are reported apart            -> mix-{disaggregated,aggregated}.json
#   summary   Markdown tables of everything in $OUT                             -> summary.md
#   all       topo transfer tail serve mix summary (longer than one device command)
#
# The device calls (the two-GPU kind). Before: scripts/gpu_bins.sh, then
# `xz -T0 -k device-bin/ferry device-bin/bench_transfer_gpu` (tree + carry must stay under 64 MiB;
# the stripped binaries are unpacked here), and scripts/ucx_cuda_pack.sh (devpack/ucx.tar.xz):
#   run(kind="nvidia-h200-x2", carry=["device-bin/ferry.xz", "device-bin/bench_transfer_gpu.xz",
#       "devpack/ucx.tar.xz"], command="OUT=$OUT bash scripts/two_gpu_run.sh topo transfer tail")
#   run(kind="nvidia-h200-x2", carry=[…], command="OUT=$OUT bash scripts/two_gpu_run.sh serve mix summary")
# A dry run with both workers on one GPU: GPUS=0,0; sized for one device command: DRY=1
#   run(carry=["device-bin/ferry.xz", "device-bin/bench_transfer_gpu.xz", "devpack/ucx.tar.xz"],
#       command="DRY=1 OUT=$OUT bash scripts/two_gpu_run.sh topo transfer tail serve mix summary") On a machine without a GPU (the script's own
# check): GPUS=cpu UP_DEVICE="--device cpu" VOCAB=2048 PROMPT=64 OUTPUT=16 LONG=600 ... serve mix.
#
# Settings (environment): OUT (default two-gpu-out), GPUS (P,D: default 0,1; `cpu` for the dry
# run), FERRY (device-bin/ferry), BENCH_TRANSFER (device-bin/bench_transfer_gpu), MODEL
# (models/dummy/deepseek-v2-lite), TRANSPORT (ucx), PROMPT (1024), OUTPUT (400), LEVELS
# (1,4,16,64,128), REQUESTS (per level, at least the concurrency; 16), MIX_LEVELS (4,16,64),
# LONG (16384), LONG_EVERY (8), KV_BLOCKS (8192 per worker), MAX_RUNNING (128), VOCAB (100000),
# TAIL_TOKENS (8192,32768), TAIL_REQUESTS (3).
set -uo pipefail
cd "$(dirname "$0")/.."
# DRY=1: the one-GPU dry run issue 18 asks for before the two-GPU kind, sized for one device
# command (~5 min, estimated): both workers on GPU 0, two levels, 64 output tokens, one 8k tail
# request, a 4k-token long prompt in the mix. Any setting given explicitly wins.
if [ "${DRY:-0}" = 1 ]; then
  GPUS=${GPUS:-0,0} LEVELS=${LEVELS:-1,16} OUTPUT=${OUTPUT:-64} MIX_LEVELS=${MIX_LEVELS:-16}
  LONG=${LONG:-4096} TAIL_TOKENS=${TAIL_TOKENS:-8192} TAIL_REQUESTS=${TAIL_REQUESTS:-1}
fi
OUT=${OUT:-two-gpu-out}
mkdir -p "$OUT/logs"
OUT=$(cd "$OUT" && pwd)
FERRY=${FERRY:-./device-bin/ferry}
BENCH_TRANSFER=${BENCH_TRANSFER:-./device-bin/bench_transfer_gpu}
MODEL=${MODEL:-models/dummy/deepseek-v2-lite}
GPUS=${GPUS:-0,1}
TRANSPORT=${TRANSPORT:-ucx}
PROMPT=${PROMPT:-1024}
OUTPUT=${OUTPUT:-400}
LEVELS=${LEVELS:-1,4,16,64,128}
REQUESTS=${REQUESTS:-16}
MIX_LEVELS=${MIX_LEVELS:-4,16,64}
LONG=${LONG:-16384}
LONG_EVERY=${LONG_EVERY:-8}
KV_BLOCKS=${KV_BLOCKS:-8192}
MAX_RUNNING=${MAX_RUNNING:-128}
VOCAB=${VOCAB:-100000}
TAIL_TOKENS=${TAIL_TOKENS:-8192,32768}
TAIL_REQUESTS=${TAIL_REQUESTS:-3}
export FERRY MODEL
# Nothing here uses NCCL; should anything, NVLink multicast stays off.
export NCCL_NVLS_ENABLE=0

if [ "$GPUS" = cpu ]; then
  P_DEV=cpu D_DEV=cpu
else
  P=${GPUS%,*} D=${GPUS#*,}
  P_DEV=cuda:$P D_DEV=cuda:$D
fi
# shellcheck source=scripts/gpu_cluster.sh
source scripts/gpu_cluster.sh

# The CUDA-enabled UCX of devpack/ucx.tar.xz (scripts/ucx_cuda_pack.sh), unless FERRY_UCX_LIB
# already names one; the GPU libraries cudarc loads (scripts/gpu_env.sh).
setup_env() {
  if [ -z "${FERRY_UCX_LIB:-}" ] && [ -f devpack/ucx.tar.xz ]; then
    mkdir -p /tmp/ucx && tar xJf devpack/ucx.tar.xz -C /tmp/ucx
    export LD_LIBRARY_PATH=/tmp/ucx/lib:/tmp/ucx/lib/ucx:/tmp/ucx/libs:${LD_LIBRARY_PATH:-} \
      UCX_MODULE_DIR=/tmp/ucx/lib/ucx FERRY_UCX_LIB=/tmp/ucx/lib/libucp.so.0
  fi
  if [ "$GPUS" != cpu ]; then
    # shellcheck source=scripts/gpu_env.sh
    source scripts/gpu_env.sh >/dev/null
  fi
  for f in "$FERRY" "$BENCH_TRANSFER"; do
    if [ -f "$f.xz" ] && [ ! -f "$f" ]; then xz -dk "$f.xz"; fi
  done
}

stage_topo() {
  { nvidia-smi -L; echo; nvidia-smi topo -m; } >"$OUT/topo.txt" 2>&1
  cat "$OUT/topo.txt"
}

stage_transfer() {
  "$BENCH_TRANSFER" --gpus "$P,$D" --tokens 1024,8192,32768 --run-mib 0,16 --runs 9 \
    --json "$OUT/transfer.json" 2>&1 | tee "$OUT/logs/transfer.log"
}

stage_tail() {
  local t
  for t in ${TAIL_TOKENS//,/ }; do
    DECODE_WORKERS=1 TOKENS=$t REQUESTS=$TAIL_REQUESTS JSON="$OUT/tail-$t.json" LOGS="$OUT/logs" \
      UP_FLAGS="--prefill-devices $P_DEV --decode-devices $D_DEV" \
      bash scripts/bench_kv_tail.sh "$TRANSPORT"
  done
}

# One serving measurement: MODE (disaggregated|aggregated), NAME (serve|mix), ferry bench flags.
serving() {
  local mode=$1 name=$2
  shift 2
  local log="$OUT/logs/up-$name-$mode.log" prefill flags
  if [ "$mode" = disaggregated ]; then
    prefill=1
    flags="--prefill-devices $P_DEV --decode-devices $D_DEV --transport $TRANSPORT"
    export DECODE_WORKERS=1
  else
    prefill=0
    flags="--decode-devices $P_DEV,$D_DEV"
    export DECODE_WORKERS=2
  fi
  # shellcheck disable=SC2086
  UP_FLAGS="$flags" up_cluster "$log" "$prefill" --kv-blocks "$KV_BLOCKS" \
    --max-running "$MAX_RUNNING" || return 1
  local pid=$CLUSTER_PID
  echo "### $name, $mode (${UP_DEVICE:-$MODEL}; prefill $([ "$prefill" = 1 ] && echo "on $P_DEV, decode on $D_DEV" || echo "on each decode worker, $P_DEV and $D_DEV"))"
  "$FERRY" bench --grpc-addr 127.0.0.1:18051 --requests-per-level "$REQUESTS" \
    --prompt-tokens "$PROMPT" --output-tokens "$OUTPUT" --vocab "$VOCAB" \
    --json "$OUT/$name-$mode.json" "$@"
  local rc=$?
  sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -E "WARN|ERROR" | grep -v tokenizer | tail -5
  kill "$pid"; wait "$pid" 2>/dev/null || true
  return $rc
}

stage_serve() {
  serving disaggregated serve --concurrency "$LEVELS"
  serving aggregated serve --concurrency "$LEVELS"
}

stage_mix() {
  serving disaggregated mix --concurrency "$MIX_LEVELS" --long-prompt-tokens "$LONG" \
    --long-every "$LONG_EVERY"
  serving aggregated mix --concurrency "$MIX_LEVELS" --long-prompt-tokens "$LONG" \
    --long-every "$LONG_EVERY"
}

stage_summary() {
  python3 - "$OUT" <<'PY' | tee "$OUT/summary.md"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.exists() else None
def f(x, nd=1):
    return "—" if x is None else f"{x:.{nd}f}"
for name, title in (("serve", "Serving"), ("mix", "Long-prompt mix")):
    rows = []
    for mode in ("disaggregated", "aggregated"):
        doc = load(f"{name}-{mode}.json")
        if not doc:
            continue
        for lv in doc["levels"]:
            cls = lv["short"] if name == "mix" else lv["all"]
            long_ttft = lv["long"]["ttft_ms"]["p50"] if name == "mix" else None
            rows.append(f"| {mode} | {lv['concurrency']} | {lv['requests']} | "
                        f"{f(cls['ttft_ms']['p50'])} / {f(cls['ttft_ms']['p99'])} | "
                        f"{f(long_ttft)} | "
                        f"{f(cls['itl_ms']['p50'], 2)} / {f(cls['itl_ms']['p99'], 2)} | "
                        f"{f(lv['output_tok_s'])} |")
    if rows:
        who = "short requests" if name == "mix" else "all requests"
        print(f"### {title} ({who})\n")
        print("| mode | concurrency | requests | TTFT p50 / p99 ms | long TTFT p50 ms | ITL p50 / p99 ms | output tok/s |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(rows) + "\n")
t = load("transfer.json")
if t:
    print("### Transfer\n\n```\n" + json.dumps(t, indent=1)[:4000] + "\n```\n")
for p in sorted(out.glob("tail-*.json")):
    print(f"### {p.name}\n\n```\n{p.read_text().strip()}\n```\n")
PY
}

setup_env
[ $# -gt 0 ] || { sed -n '2,40p' "$0"; exit 2; }
if [ "$1" = all ]; then set -- topo transfer tail serve mix summary; fi
status=0
for stage in "$@"; do
  echo "== $stage ($(date -u +%H:%M:%S))"
  case "$stage" in
    topo | transfer | tail | serve | mix | summary) "stage_$stage" || status=1 ;;
    *) echo "unknown stage: $stage"; exit 2 ;;
  esac
done
exit $status
