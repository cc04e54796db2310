#!/usr/bin/env bash
# The whole test suite: formatting, lints, and every unit and integration test.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ensure-toolchain.sh
rustup component add rustfmt clippy >/dev/null 2>&1 || true
cargo fmt --all -- --check
cargo clippy --locked --all-targets -q -- -D warnings
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --locked --workspace 2>&1 | tee "$log"
# One closing line over all test binaries (cargo prints one per binary, the last often a doc-test
# run with nothing in it).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i; if ($(i+1) ~ /^ignored/) s += $i } }
     END { printf "tests: %d passed, %d failed, %d skipped\n", p, f, s }' "$log"
