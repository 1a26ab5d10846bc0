#!/usr/bin/env bash
# Compile-checks every CUDA kernel without a GPU: NVRTC (from NVIDIA's pip wheel) compiles each
# source for sm_80 and sm_90a with the model shapes the tests use, then ptxas assembles the
# PTX. NVRTC passes inline PTX (mma, ldmatrix, cp.async, wgmma) through unchecked; ptxas is what
# rejects a bad operand or an unsupported instruction, so both steps matter. CI runs this.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --disable-pip-version-check \
    --root-user-action=ignore nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-nvcc-cu12==12.9.86
pkg() { python3 -c "import importlib.util as u; print(list(u.find_spec('nvidia.$1').submodule_search_locations)[0])"; }
nvrtc_lib="$(pkg cuda_nvrtc)/lib"
ptxas="$(pkg cuda_nvcc)/bin/ptxas"
out="$(mktemp -d)"
# `--workspace`, as README's test command builds: dependencies resolved for the whole workspace
# are the ones that build already made, so only the test binary is new (with `-p ferry-kernels`
# cargo resolves their features anew and rebuilds them).
LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" FERRY_PTX_DIR="$out" \
    cargo test --locked --workspace --test cuda_parity nvrtc_compiles_every_source -- --include-ignored
n=$(find "$out" -name '*.ptx' | wc -l)
[ "$n" -gt 0 ] || { echo "no PTX was written" >&2; exit 1; }
# One ptxas per core, each PTX for the architecture its `.target` line names; any failure fails
# the script (xargs exits non-zero).
assemble() {
  local arch
  arch=$(awk '/^\.target/ {print $2; exit}' "$1")
  "$PTXAS" --gpu-name "$arch" "$1" -o /dev/null
}
export -f assemble
export PTXAS="$ptxas"
find "$out" -name '*.ptx' -print0 | xargs -0 -P "$(nproc)" -n 1 bash -c 'assemble "$1"' assemble
echo "ptxas assembled $n PTX files"
rm -rf "$out"
