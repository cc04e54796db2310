#!/usr/bin/env bash
# A Python virtual environment with the pinned client packages the server tests drive
# (tests/clients/requirements.txt: openai, anthropic, tiktoken, huggingface_hub, pytest). Sourced by test.sh;
# sets CLIENT_PY. Reuses the venv when its requirements file is unchanged.
set -euo pipefail

venv=${DELTAFIN_CLIENT_VENV:-target/venv-clients}
req=tests/clients/requirements.txt
if [ ! -x "$venv/bin/python" ] || ! cmp -s "$req" "$venv/requirements.txt"; then
  rm -rf "$venv"
  if ! python3 -m venv "$venv" >/dev/null 2>&1; then
    rm -rf "$venv"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3 python3-venv
    # The first python3 on PATH may not be Debian's (whose venv module the package provides).
    python3 -m venv "$venv" >/dev/null 2>&1 || { rm -rf "$venv"; /usr/bin/python3 -m venv "$venv"; }
  fi
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$req"
  cp "$req" "$venv/requirements.txt"
fi
CLIENT_PY="$venv/bin/python"
