#!/usr/bin/env bash
# Source on the GPU machine before running ferry's GPU binaries: puts the directories holding
# libnvrtc.so.13 and libcublas.so.13 (CUDA toolkit or PyTorch's nvidia-* wheels) on
# LD_LIBRARY_PATH, since cudarc loads them at run time. See docs/gpu.md.
for lib in libnvrtc.so.13 libcublas.so.13 libcublasLt.so.13; do
  for root in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu \
              $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
    # `|| true`: a missing root fails `find`, which must not end a `set -e -o pipefail` caller
    # (scripts/dspark_lease.sh sources this in its stages, also on a machine without CUDA).
    hit=$(find "$root" -maxdepth 5 -name "$lib" 2>/dev/null | head -1 || true)
    if [ -n "$hit" ]; then
      d=$(dirname "$hit")
      case ":${LD_LIBRARY_PATH:-}:" in *":$d:"*) ;; *) export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}";; esac
      break
    fi
  done
done
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
