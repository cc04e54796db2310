#!/usr/bin/env bash
# The coding-agent CLI the client tests drive against `deltafin serve` (tests/clients/
# test_codex_cli.py): OpenAI's Codex CLI from npm, pinned, in target/agent-clis. Installs
# Debian's nodejs and npm first when there is no npm. Sourced by test.sh; sets DELTAFIN_CODEX.
set -euo pipefail
codex_version=0.171.0
prefix=target/agent-clis
if ! command -v npm >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nodejs npm >/dev/null
fi
if [ "$(cat "$prefix/codex-version" 2>/dev/null)" != "$codex_version" ] || [ ! -x "$prefix/node_modules/.bin/codex" ]; then
  rm -rf "$prefix"
  mkdir -p "$prefix"
  npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error "@openai/codex@$codex_version" >/dev/null
  echo "$codex_version" > "$prefix/codex-version"
fi
export DELTAFIN_CODEX="$PWD/$prefix/node_modules/.bin/codex"
echo "codex: $("$DELTAFIN_CODEX" --version 2>/dev/null | tail -1)"
