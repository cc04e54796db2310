#!/usr/bin/env bash
# Make sure a C toolchain and a Rust toolchain new enough for edition 2024 (1.89+) are present.
# Sourced by demo.sh and test.sh; installs only what is missing.
set -euo pipefail

need_apt=()
command -v cc >/dev/null 2>&1 || need_apt+=(build-essential)
command -v curl >/dev/null 2>&1 || need_apt+=(curl ca-certificates)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi

[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
rust_ok() {
  command -v cargo >/dev/null 2>&1 || return 1
  local v
  v=$(rustc --version | awk '{print $2}')
  [ "$(printf '%s\n1.89.0\n' "$v" | sort -V | head -1)" = "1.89.0" ]
}
if ! rust_ok; then
  echo "installing the Rust toolchain with rustup (edition 2024 needs 1.89 or newer)" >&2
  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
  . "$HOME/.cargo/env"
fi
