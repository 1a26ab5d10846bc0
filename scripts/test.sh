#!/usr/bin/env bash
# ferry's test command (what CI runs): the Python clients used by the cluster tests
# (tests/python/requirements.txt), then every Rust test of the workspace.
# Run from anywhere; extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
# A distribution's Python may be "externally managed" (PEP 668); these pinned test clients go
# into it anyway, as root on CI.
PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --disable-pip-version-check \
    --root-user-action=ignore -r tests/python/requirements.txt
cargo test --workspace --locked "$@"
