#!/usr/bin/env bash
# Packs the CUDA-enabled UCX of PyPI's `libucx-cu13` wheel (ucp/uct/ucs/ucm + the cuda_copy,
# cuda_ipc and cma modules, ~4 MB as .tar.xz) into devpack/ucx.tar.xz for the GPU machine,
# which has no network (docs/gpu.md). On the GPU machine:
#   mkdir -p /tmp/ucx && tar xJf devpack/ucx.tar.xz -C /tmp/ucx
#   export LD_LIBRARY_PATH=/tmp/ucx/lib:/tmp/ucx/lib/ucx:/tmp/ucx/libs:$LD_LIBRARY_PATH \
#          UCX_MODULE_DIR=/tmp/ucx/lib/ucx FERRY_UCX_LIB=/tmp/ucx/lib/libucp.so.0
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps "libucx-cu13==1.22.0" -d "$work"
unzip -q "$work"/libucx_cu13-*.whl -d "$work/w"
pack="$work/pack"
mkdir -p "$pack/lib/ucx" "$pack/libs"
for l in ucp uct ucs ucm ucs_signal; do cp -L "$work/w/libucx/lib/lib$l.so.0" "$pack/lib/"; ln -s "lib$l.so.0" "$pack/lib/lib$l.so"; done
for m in uct_cuda ucm_cuda uct_cma; do cp -L "$work/w/libucx/lib/ucx/lib$m.so.0" "$pack/lib/ucx/"; ln -s "lib$m.so.0" "$pack/lib/ucx/lib$m.so"; done
cp "$work"/w/libucx_cu13.libs/* "$pack/libs/"
mkdir -p devpack
tar cJf devpack/ucx.tar.xz -C "$pack" .
ls -la devpack/ucx.tar.xz
