#!/usr/bin/env bash
# Line coverage of the parsers under their fuzz targets (outside CI): an instrumented build of
# each crate's fuzz tests, DELTAFIN_FUZZ_CASES cases per target (default 2000), and llvm-cov's
# per-file report. Needs rustup's llvm-tools component (installed here if missing).
#   bash scripts/fuzz-coverage.sh [OUTDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/fuzz-coverage}
rustup component add llvm-tools >/dev/null 2>&1 || true
bin=$(dirname "$(find "$(rustc --print sysroot)" -name llvm-profdata -type f | head -1)")
rm -rf "$out"
mkdir -p "$out"
out=$(cd "$out" && pwd)
export CARGO_TARGET_DIR=target/coverage RUSTFLAGS="-C instrument-coverage"
for spec in deltafin-store:store deltafin-text:text deltafin-server:server; do
  pkg=${spec%%:*}
  name=${spec##*:}
  mkdir -p "$out/$name"
  LLVM_PROFILE_FILE="$out/$name/%p-%m.profraw" DELTAFIN_FUZZ_CASES=${DELTAFIN_FUZZ_CASES:-2000} \
    cargo test -q -p "$pkg" --test fuzz 2>&1 | grep -E "test result" || true
  exe=$(cargo test -p "$pkg" --test fuzz --no-run 2>&1 | grep -o 'target/coverage/debug/deps/fuzz-[0-9a-f]*' | head -1)
  "$bin/llvm-profdata" merge -sparse "$out/$name"/*.profraw -o "$out/$name.profdata"
  "$bin/llvm-cov" report "$exe" -instr-profile="$out/$name.profdata" \
    --ignore-filename-regex='(\.cargo|rustc|/tests/)' >"$out/$name.txt"
  echo "== $name: $out/$name.txt"
done
