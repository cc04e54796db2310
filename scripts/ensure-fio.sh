#!/usr/bin/env bash
# fio, the drive limit's reference (`bench` replays each run's reads with it: crates/cli/src/
# drive_limit.rs). Installs Debian's fio when none is found; where it then runs, the tests are
# told that it must be used (DELTAFIN_REQUIRE_FIO=1), so a bench test that would fall back to
# the internal replay fails instead. Where apt cannot be used, says so: the tests then check the
# internal replay. Sourced by test.sh and the bench scripts.
set -euo pipefail
if ! command -v fio >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq fio; } >/dev/null 2>&1 || true
fi
if fio --version >/dev/null 2>&1; then
  export DELTAFIN_REQUIRE_FIO=1
  echo "fio: $(fio --version): required of the tests"
else
  export DELTAFIN_REQUIRE_FIO=0
  echo "fio: not installed here: bench floors use deltafin's own replay"
fi
