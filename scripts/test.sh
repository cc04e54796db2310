#!/usr/bin/env bash
# The whole test suite: formatting, lints, and every unit and integration test.
set -euo pipefail
cd "$(dirname "$0")/.."
# Where the run's time goes: seconds since the start before each phase (CI is kept well under
# 30 minutes on 2 cores; these lines say which phase to look at when it grows).
phase() { echo "[test.sh ${SECONDS} s] $*"; }
phase "toolchain"
. scripts/ensure-toolchain.sh
rustup component add rustfmt clippy >/dev/null 2>&1 || true
phase "fmt and clippy"
cargo fmt --all -- --check
# Lints for both builds, so that neither rots: as released, and with the test instruments of
# `deltafin serve` (`--script`, `--token-delay-ms`; cargo feature `test-instruments`).
cargo clippy --locked --all-targets -q -- -D warnings
cargo clippy --locked --all-targets -q --features deltafin/test-instruments -- -D warnings
# The same lints for macOS (Apple Silicon) and Windows.
phase "platform lints"
. scripts/check-platforms.sh
phase "nginx, fio and vulkan"
# nginx, for the installs from a plain HTTP mirror (crates/cli/tests/install_mirror.rs).
. scripts/ensure-nginx.sh
# fio, for the disk limit of `bench` (a replay of each run's own reads).
. scripts/ensure-fio.sh
# Mesa's software Vulkan driver, for the GPU backend's shaders (crates/gpu/tests).
. scripts/ensure-vulkan.sh
# The client tests' Python (installed with python3 itself where the machine has none), here
# already: the io_uring probe below runs on it, so a bare machine cannot turn the probe into
# "refused" for want of a python3 and let the io_uring tests skip.
. scripts/ensure-client-venv.sh
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# One probe: where this kernel grants an io_uring ring, the tests below must exercise io_uring,
# and a test that would skip its io_uring part fails instead (DELTAFIN_REQUIRE_IO_URING).
uring=0
if [ "$(uname -s)" = Linux ]; then
  # io_uring_setup(4, &params) is syscall 425 on every Linux architecture.
  uring=$("$CLIENT_PY" -c 'import ctypes, os
p = ctypes.create_string_buffer(120)
fd = ctypes.CDLL(None, use_errno=True).syscall(425, 4, p)
print(1 if fd >= 0 else 0)
fd >= 0 and os.close(fd)' 2>/dev/null || echo 0)
fi
echo "io_uring: $([ "$uring" = 1 ] && echo "granted: required of the tests" || echo "refused here: its tests report SKIPPED")"
# As released: `serve` has no test-instrument flags. Run before the build below, which must be
# the one that leaves target/debug/deltafin behind. `--workspace` so that the dependencies get
# the same features as in that build and are compiled once for both (with `-p deltafin` they
# were compiled twice: about 4 of CI's 30 minutes).
phase "tests of the released binary"
DELTAFIN_REQUIRE_IO_URING=$uring cargo test --locked --workspace --bin deltafin 2>&1 | tee "$log"
# Everything, with the test instruments (the client tests below drive `serve --script`).
phase "workspace tests"
DELTAFIN_REQUIRE_IO_URING=$uring cargo test --locked --workspace --features deltafin/test-instruments 2>&1 | tee -a "$log"
phase "NEON kernels under qemu"
# The NEON kernels, cross-built for aarch64 and run under qemu.
. scripts/test-neon.sh
phase "valgrind"
# The I/O error paths under valgrind (reads in flight never land in freed buffers).
. scripts/test-valgrind.sh
phase "client tests"
# The server against the official openai and anthropic clients (and raw HTTP), on loopback,
# using the binary cargo test just built (with the test instruments), from the venv set up above.
# OpenAI's Codex CLI (npm), for one real agent's tool-call round trip over /v1/responses.
. scripts/ensure-agent-clis.sh
DELTAFIN_BIN=${CARGO_TARGET_DIR:-target}/debug/deltafin "$CLIENT_PY" -m pytest tests/clients -q -p no:cacheprovider 2>&1 | tee -a "$log"
# One closing line over all test binaries (cargo prints one per binary, the last often a doc-test
# run with nothing in it) and the pytest run ("N passed, N skipped in Xs").
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i; if ($(i+1) ~ /^ignored/) s += $i } }
     /^(=+ )?[0-9]+ (passed|failed|skipped|error).* in [0-9.]+s/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i; if ($(i+1) ~ /^skipped/) s += $i; if ($(i+1) ~ /^error/) f += $i } }
     END { printf "tests: %d passed, %d failed, %d skipped\n", p, f, s }' "$log"
phase "done"
