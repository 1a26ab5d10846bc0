# Sourced by the A/B scripts (bench_decode_arms.sh, bench_gemv_mma.sh): one arm is `default` (no
# switch set) or comma-joined VAR=value settings.
# An arm's environment assignments, one per line, split only at commas that start the next VAR=
# (so values may hold commas: FERRY_L2_WARM=shared,o_proj,last is one setting).
settings() { [ "$1" = default ] || echo "$1" | sed -E 's/,([A-Z][A-Z0-9_]*=)/\n\1/g'; }
# A file-name tag for an arm.
tag() { echo "$1" | tr -c 'A-Za-z0-9_.\n-' '_'; }
