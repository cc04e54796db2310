#!/usr/bin/env bash
# The NEON kernels on an x86 machine: cross-build the kernels' tests for aarch64 and run them
# under qemu's user-mode emulator, where the NEON paths are checked against the scalar oracles
# (and the x86 paths report SKIPPED). Installs the aarch64 Rust target, a cross linker and qemu
# when missing; if they cannot be had, says SKIPPED and exits 0. Sourced by test.sh (needs $log).
set -euo pipefail
neon_tools() {
  command -v qemu-aarch64 >/dev/null 2>&1 && command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 &&
    rustup target list --installed 2>/dev/null | grep -qx aarch64-unknown-linux-gnu
}
if ! neon_tools; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  { $SUDO apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross &&
    rustup target add aarch64-unknown-linux-gnu; } >/dev/null 2>&1 || true
fi
if neon_tools && [ "$(uname -m)" != aarch64 ]; then
  CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
  CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu" \
    cargo test --locked -p deltafin-kernels --lib --target aarch64-unknown-linux-gnu 2>&1 | tee -a "$log"
elif [ "$(uname -m)" = aarch64 ]; then
  echo "NEON kernels: this is an aarch64 machine; cargo test above ran them natively"
else
  echo "SKIPPED NEON kernels: could not install qemu-user, the aarch64 cross linker or the aarch64 Rust target"
fi
