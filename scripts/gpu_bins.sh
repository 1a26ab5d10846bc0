#!/usr/bin/env bash
# Builds the release binaries the GPU machine runs (it has no Rust toolchain) and copies them
# into device-bin/ (git-ignored; pass it as `carry`). See docs/gpu.md.
#   scripts/gpu_bins.sh            # build + copy
#   scripts/gpu_bins.sh --no-build # copy what target/ already holds
#   scripts/gpu_bins.sh --pack     # build + copy, then one device-bin/pack.tar.xz instead
#                                  # (xz -9: the binaries share most of their code, so the
#                                  # pack is a fraction of their sum; scripts/gpu_tests.sh
#                                  # unpacks it)
set -euo pipefail
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-target}"
if [ "${1:-}" != "--no-build" ]; then
  cargo build --release -p ferry -p ferry-model --example bench_gpu
  cargo build --release -p ferry --example bench_transfer_gpu
  cargo test --release --no-run -p ferry-kernels --test cuda_parity --test backend --test backend_sample --test backend_draft -p ferry-model --test gpu_parity --test engine_device --test backend_model --test spec_drafter
  cargo test --release --no-run -p ferry --test cluster_device --test generate --test cluster_spec --test observability --test ucx_device
fi
mkdir -p device-bin
cp "$target/release/ferry" "$target/release/examples/bench_gpu" "$target/release/examples/bench_transfer_gpu" device-bin/
TESTS="cuda_parity backend backend_sample backend_draft backend_model gpu_parity engine_device spec_drafter cluster_device generate cluster_spec observability ucx_device"
for t in $TESTS; do
  bin=$(ls -t "$target"/release/deps/$t-* | grep -v '\.d$' | head -1)
  cp "$bin" "device-bin/$t"
done
# Debug info makes the binaries ~300 MB; the device tool carries at most 64 MiB.
strip device-bin/ferry device-bin/bench_gpu device-bin/bench_transfer_gpu
for t in $TESTS; do strip "device-bin/$t"; done
# Test binaries find the embedded model through the absolute source path they were built in;
# the device command links that path to its copy of the tree.
pwd > device-bin/SRC_ROOT
# tests/observability.rs's OTLP receiver, the `rotel` wheel's agent: the GPU machine has no
# network to install it, and without it that test returns early (session 52). It goes apart,
# as device-bin/rotel-agent.xz (7 MB; never in the pack), so that a call carries it only when it
# runs that test: the pack, the corpus and the tree of a training lease leave no room for it
# under the 64 MiB carry. ROTEL_AGENT=none leaves it out.
agent=${ROTEL_AGENT:-$(python3 -c 'import os, rotel; print(os.path.join(os.path.dirname(rotel.__file__), "rotel-agent"))' 2>/dev/null || true)}
if [ "$agent" != none ] && [ -x "$agent" ]; then
  xz -9 -T2 -c "$agent" > device-bin/rotel-agent.xz
  # The agent links the wheel's Python (libpython3.11), which the GPU machine lacks (session 54:
  # the receiver never listened until it was carried): its libpython goes beside it, in
  # device-bin/rotel-libs.tar.xz (2 MB), put on LD_LIBRARY_PATH by scripts/gpu_tests.sh.
  libs=$(ldd "$agent" | awk '/libpython/ && $3 ~ /^\// {print $3}')
  if [ -n "$libs" ]; then
    # shellcheck disable=SC2086
    tar chf - -C / $(for l in $libs; do echo "${l#/}"; done) --transform 's,.*/,,' \
      | xz -9 -T2 > device-bin/rotel-libs.tar.xz
  fi
else
  echo "gpu_bins.sh: no rotel-agent (pip install rotel): observability's GPU test will not run" >&2
fi
if [ "${1:-}" = "--pack" ]; then
  files=$(cd device-bin && ls | grep -v -e '^pack\.tar\.xz$' -e '^rotel-agent\.xz$' -e '^rotel-libs\.tar\.xz$')
  # shellcheck disable=SC2086
  tar cf - -C device-bin $files | xz -9 -T2 > device-bin/pack.tar.xz
  # shellcheck disable=SC2086
  (cd device-bin && rm -f $files)
fi
ls -la device-bin
