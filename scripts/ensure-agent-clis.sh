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
  # The registry can drop a connection part-way (a CI run once failed here with nothing but
  # npm's pointer to its log): try three times, and show the log's errors when the last fails.
  for attempt in 1 2 3; do
    if npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error \
      --fetch-retries=4 --fetch-retry-mintimeout=5000 "@openai/codex@$codex_version" >/dev/null; then
      break
    fi
    if [ "$attempt" = 3 ]; then
      echo "npm could not install @openai/codex@$codex_version; the end of its log:" >&2
      tail -n 40 "$(ls -t "$HOME"/.npm/_logs/*-debug-*.log 2>/dev/null | head -1)" >&2 || true
      df -h "$prefix" >&2 || true
      exit 1
    fi
    echo "npm install failed (attempt $attempt of 3); trying again" >&2
    rm -rf "$prefix/node_modules"
    sleep $((attempt * 10))
  done
  echo "$codex_version" > "$prefix/codex-version"
fi
export DELTAFIN_CODEX="$PWD/$prefix/node_modules/.bin/codex"
echo "codex: $("$DELTAFIN_CODEX" --version 2>/dev/null | tail -1)"
