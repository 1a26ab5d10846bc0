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
LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" FERRY_PTX_DIR="$out" \
    cargo test --locked -p ferry-kernels --test cuda_parity nvrtc_compiles_every_source -- --include-ignored
n=0
for f in "$out"/*.ptx; do
  arch=$(awk '/^\.target/ {print $2; exit}' "$f")
  "$ptxas" --gpu-name "$arch" "$f" -o /dev/null
  n=$((n + 1))
done
[ "$n" -gt 0 ] || { echo "no PTX was written" >&2; exit 1; }
echo "ptxas assembled $n PTX files"
rm -rf "$out"
