#!/usr/bin/env bash
# The whole test suite: formatting, lints, and every unit and integration test.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ensure-toolchain.sh
rustup component add rustfmt clippy >/dev/null 2>&1 || true
cargo fmt --all -- --check
cargo clippy --locked --all-targets -q -- -D warnings
cargo test --locked --workspace
