#!/usr/bin/env bash
# Lints every crate, test and bench for macOS on Apple Silicon and for Windows (MSVC, the
# toolchain rustup installs there by default) as the native build is linted: the platform
# modules (engine/src/os, store/src/os.rs, stream/uring.rs) must compile everywhere. Type-checking needs only each target's standard library, which rustup
# installs here; nothing is linked, so no macOS SDK or Windows linker is needed (and these
# builds have never run on those systems: see docs/platforms.md). Sourced by test.sh.
set -euo pipefail
command -v rustup >/dev/null || { echo "the platform lints need rustup (scripts/ensure-toolchain.sh installs it)" >&2; exit 1; }
targets=(aarch64-apple-darwin x86_64-pc-windows-msvc)
for target in "${targets[@]}"; do
  if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
    echo "installing the Rust standard library for $target" >&2
    rustup target add "$target" >&2
  fi
done
# One cargo run for both targets: their crates compile side by side on every core.
echo "clippy for ${targets[*]}" >&2
cargo clippy --locked --workspace --all-targets -q --target "${targets[0]}" --target "${targets[1]}" -- -D warnings
echo "platform check: ${targets[*]}: clippy -D warnings clean"
