#!/usr/bin/env bash
# Runs on the GPU machine (docs/gpu.md): the named test binaries of device-bin/ with their
# GPU (ignored) tests, one log per binary under $OUT (else ./gpu-logs), and a one-line summary
# each. Binaries that are not there are reported as missing, not run.
#   scripts/gpu_tests.sh backend_sample backend_draft engine_device ...
# Environment: GPU_TEST_FILTER: a test-name filter for every binary (default: all tests);
# GPU_TEST_TIMEOUT: seconds per binary (300); FERRY_TEST_DEVICE=cuda runs tests/observability.rs's cluster on the GPU;
# ROTEL_AGENT=path its OTLP receiver (device-bin/rotel-agent, or .xz, when carried there).
set -uo pipefail
cd "$(dirname "$0")/.."
# This links target/release/ferry to device-bin/ferry: on a machine where cargo built a real
# one it would replace it (the device machine has no target/).
if [ -f target/release/ferry ] && [ ! -L target/release/ferry ]; then
  echo "gpu_tests.sh: target/release/ferry is a build of this machine's; run this on the GPU machine" >&2
  exit 2
fi
# A packed device-bin/ (scripts/gpu_bins.sh --pack): `carry` brings the pack on every call.
if [ -f device-bin/pack.tar.xz ] && [ ! -f device-bin/SRC_ROOT ]; then
  tar xJf device-bin/pack.tar.xz -C device-bin || exit 1
fi
out="${OUT:-gpu-logs}"
mkdir -p "$out"
# shellcheck disable=SC1091
source scripts/gpu_env.sh >/dev/null
# Test binaries find the embedded model (and cluster tests the ferry binary) through the
# absolute paths they were built with: point those at this copy of the tree.
root=$(cat device-bin/SRC_ROOT)
if [ "$root" != "$PWD" ]; then
  mkdir -p "$(dirname "$root")"
  ln -sfn "$PWD" "$root"
fi
mkdir -p target/release
ln -sfn "$PWD/device-bin/ferry" target/release/ferry
# The OTLP receiver, carried apart (scripts/gpu_bins.sh).
if [ -f device-bin/rotel-agent.xz ] && [ ! -x device-bin/rotel-agent ]; then
  xz -dc device-bin/rotel-agent.xz > device-bin/rotel-agent && chmod +x device-bin/rotel-agent
fi
if [ -x device-bin/rotel-agent ] && [ -z "${ROTEL_AGENT:-}" ]; then
  export ROTEL_AGENT="$PWD/device-bin/rotel-agent"
fi
# The libraries the agent links that the GPU machine lacks (libpython3.11), carried beside it.
if [ -f device-bin/rotel-libs.tar.xz ]; then
  mkdir -p device-bin/rotel-libs && tar xJf device-bin/rotel-libs.tar.xz -C device-bin/rotel-libs
  export LD_LIBRARY_PATH="$PWD/device-bin/rotel-libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
for t in "$@"; do
  # As cargo names it (`engine_device-<hash>`) when copied without renaming.
  if [ ! -x "device-bin/$t" ]; then
    hashed=(device-bin/"$t"-*)
    if [ ${#hashed[@]} -eq 1 ] && [ -x "${hashed[0]}" ]; then
      ln -sfn "$(basename "${hashed[0]}")" "device-bin/$t"
    else
      echo "$t: missing"
      continue
    fi
  fi
  start=$(date +%s)
  # shellcheck disable=SC2086
  timeout "${GPU_TEST_TIMEOUT:-300}" "./device-bin/$t" ${GPU_TEST_FILTER:-} --include-ignored \
    --test-threads=1 --nocapture >"$out/$t.log" 2>&1
  rc=$?
  result=$(grep -E '^test result' "$out/$t.log" | tail -1)
  echo "$t: rc=$rc ${result:-no result} ($(($(date +%s) - start)) s)"
  grep -E '^test .* FAILED|panicked' "$out/$t.log" | head -5
done
