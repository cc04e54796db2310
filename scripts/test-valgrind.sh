#!/usr/bin/env bash
# Memory safety of the I/O error paths under valgrind: the raw read probe ends on a failed read
# while other reads are in flight, and those reads must never land in freed buffers (they did
# before the probe's buffers were made to outlive its back-end). Installs valgrind when missing;
# if it cannot be had, says SKIPPED. Sourced by test.sh (needs $log).
set -euo pipefail
if ! command -v valgrind >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq valgrind; } >/dev/null 2>&1 || true
fi
if command -v valgrind >/dev/null 2>&1; then
  # The test binary's path as cargo prints it (relative, or absolute under CARGO_TARGET_DIR).
  exe=$(cargo test --locked -p deltafin-engine --test probe_fault --no-run 2>&1 | grep -o '[^ (]*debug/deps/probe_fault-[0-9a-f]*' | head -1)
  exe=$(realpath "$exe")
  (cd crates/engine && valgrind -q --error-exitcode=9 "$exe" --test-threads 1) 2>&1 | tee -a "$log"
else
  echo "SKIPPED valgrind: could not install it"
fi
