#!/usr/bin/env bash
# nginx for the mirror install tests (crates/cli/tests/install_mirror.rs serve a snapshot's
# files from a plain directory with it). Installs Debian's nginx-light (else nginx) when no
# nginx is found; if apt cannot be used, says so and goes on: those tests then print
# "SKIPPED: nginx not installed" and pass. Sourced by test.sh.
set -euo pipefail
have_nginx() {
  command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]
}
if ! have_nginx && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  # Only the binary is wanted: the package's own service is never started by the tests.
  { $SUDO apt-get update -qq &&
    { DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nginx-light ||
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nginx; }; } >/dev/null 2>&1 || true
fi
if ! have_nginx; then
  echo "SKIPPED nginx mirror install tests: could not install nginx"
fi
