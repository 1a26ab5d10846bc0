#!/usr/bin/env bash
# Runs the ROCm backend's contract tests on the CPU: tools/hip-emu (the HIP runtime and hipRTC
# calls ferry makes, implemented with the system C++ compiler and fibers) is linked as
# libamdhip64.so.5 and put in front of Debian's on the library path, so `RocmDevice::open(0)`
# opens a device whose kernels — every portable kernel of kernels/src/gpu/*.cu, through the same
# launchers as on an AMD or NVIDIA GPU — run on this machine's CPU. What that checks and what
# it cannot (timing, races, the PTX paths): tools/hip-emu/src/lib.rs and docs/gpu.md.
#
#   scripts/hip_emu.sh            the kernels' and the model's contract tests (~1.5 min after
#                                 the build; CI)
#   scripts/hip_emu.sh --engine   also the serving engine on rocm:0, plainly and speculating
#                                 (~8 more minutes)
#   scripts/hip_emu.sh -- ARGS    one `cargo test` of your own under the CPU HIP (e.g. `-- -p
#                                 ferry-kernels --features rocm --test backend_draft markov`)
#
# Needs Debian's libamdhip64-dev (headers and the link-time library, as for `--features rocm`)
# and a C++ compiler (`CXX`, default c++). Compiled kernel modules are cached under
# target/hip-emu/modules (FERRY_HIP_EMU_CACHE).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${CARGO_TARGET_DIR:-target}
# Absolute, so the library path below is right for an absolute CARGO_TARGET_DIR too (a relative
# one was the only kind that worked: "$PWD/$TARGET" of an absolute path named nothing, the
# system's HIP loaded, and every GPU test skipped as "no device").
case $TARGET in /*) ;; *) TARGET=$PWD/$TARGET ;; esac
if [ ! -f /usr/include/hip/hip_runtime_api.h ]; then
  echo "hip_emu.sh: needs Debian's libamdhip64-dev (apt-get install libamdhip64-dev)" >&2
  exit 2
fi
cargo build -q -p ferry-hip-emu --locked
mkdir -p "$TARGET/hip-emu/lib"
# The Rust static library, linked as HIP's shared library with HIP's symbol version.
${CC:-cc} -shared -o "$TARGET/hip-emu/lib/libamdhip64.so.5" \
  -Wl,--whole-archive "$TARGET/debug/libferry_hip_emu.a" -Wl,--no-whole-archive \
  -Wl,--version-script=tools/hip-emu/hip.map -Wl,-soname,libamdhip64.so.5 -lpthread -ldl -lm
export LD_LIBRARY_PATH="$TARGET/hip-emu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FERRY_HIP_EMU_CACHE=${FERRY_HIP_EMU_CACHE:-$TARGET/hip-emu/modules}
export HIP_PATH=/usr

# The test targets below by name over the whole workspace with the ROCm rows on: dependencies
# then resolve as for README's `cargo test --workspace`, so that build (CI runs it next) reuses
# them rather than rebuilding every crate whose features a `-p` selection would change.
ROCM="--workspace --features ferry/rocm"

if [ "${1:-}" = "--" ]; then
  shift
  exec cargo test --locked "$@"
fi
# The kernels' contract tests against the CPU backend, with a block's threads run in increasing
# and then in decreasing order between barriers: a thread reading shared memory another wrote
# with no barrier between gets different values in the two orders (tools/hip-emu/src/fiber.rs,
# `reverse_order`), so such a race fails one of the runs. The two losslessness tests
# (chi-square over 40,000 sequences each) take over ten minutes here; the CPU and the GPUs run
# them.
for order in forward reverse; do
  FERRY_HIP_EMU_ORDER=$order cargo test -q $ROCM --locked \
    --test backend --test backend_draft --test backend_sample -- --skip lossless
done
FERRY_HIP_EMU_ORDER=reverse cargo test -q -p ferry-hip-emu --locked
# The model over Backend::Rocm: golden-prompt logits against the CPU backend.
cargo test -q $ROCM --locked --test backend_model
# The DSpark drafter on the device (its Markov steps, sampling, draws) against the CPU drafter.
cargo test -q $ROCM --locked --test spec_drafter -- \
  --include-ignored drafter_on_a_gpu_matches_the_cpu_drafter
if [ "${1:-}" = "--engine" ]; then
  # The serving engine on rocm:0: golden tokens and a prefix-cache hit, a prefill job's shipped
  # rows, `auto` picking it, speculative decoding equal to plain decoding (and round for round
  # the reference's counts), the CPU engine's tokens under logits controls, prompt
  # log-probabilities and a JSON schema, late prompts in forwards of their own, uniform
  # rounds narrower than the block, and rounds whose drafts stay on the device beside late
  # prompts.
  cargo test -q $ROCM --locked --test engine_device -- \
    --include-ignored rocm_engine_serves_the_cpu_engines_tokens \
    an_unopenable_gpu_is_an_error_and_auto_picks_a_device_that_serves \
    speculative_greedy_on_a_gpu_equals_plain_and_the_cpu \
    whole_generations_on_a_gpu_accept_what_the_reference_drafter_accepts \
    gpu_engine_greedy_equals_the_cpu_engine logits_controls_on_a_gpu_equal_the_cpu_engine \
    prompt_logprobs_on_a_gpu_equal_the_cpu_engine json_schema_output_on_a_gpu_equals_the_cpu_engine \
    prompts_apart_on_a_gpu_keep_the_golden_tokens narrower_uniform_rounds_on_a_gpu_keep_the_golden_tokens \
    queued_drafts_beside_late_prompts_on_a_gpu_keep_the_golden_tokens
fi
