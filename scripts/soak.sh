#!/usr/bin/env bash
# Soak test of `deltafin serve` on loopback; not part of CI (scripts/test.sh does not run it).
#
#   scripts/soak.sh                      # 3 minutes, 8 clients, --queue 4
#   SOAK_SECONDS=600 SOAK_CLIENTS=16 scripts/soak.sh
#
# Builds the release binary (cargo build --release -p deltafin; a no-op when it is current) unless
# DELTAFIN_BIN names one, converts fixtures/k3-tiny/hf into a temporary store, and runs
# tests/soak/soak.py with the pinned openai/anthropic clients of the client-test venv: mixed chat,
# completions, messages, streams closed mid-way, hostile bodies and /tokenize, reporting what
# was served, 429s, client-side errors by kind, 5xx answers and the server's RSS every 30 s.
# Exits non-zero if the server died or panicked, answered a 5xx, or its RSS grew by more than
# SOAK_MAX_RSS_GROWTH_MB (default 64) between the first periodic report and the end.
# SOAK_ACTIONS=chat,tokenize,... runs only those actions (tests/soak/soak.py --help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${SOAK_SECONDS:-180}
clients=${SOAK_CLIENTS:-8}
queue=${SOAK_QUEUE:-4}
growth=${SOAK_MAX_RSS_GROWTH_MB:-64}

if [ -n "${DELTAFIN_BIN:-}" ]; then
  bin=$DELTAFIN_BIN
else
  . scripts/ensure-toolchain.sh
  cargo build --release -p deltafin
  bin=${CARGO_TARGET_DIR:-target}/release/deltafin
fi
[ -x "$bin" ] || { echo "no deltafin binary at $bin" >&2; exit 1; }

. scripts/ensure-client-venv.sh

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$bin" convert --from fixtures/k3-tiny/hf --to "$work/store" --spine int8 >/dev/null
echo "soak: $bin, ${seconds}s, $clients clients, --queue $queue (store and server log in $work)"
status=0
"$CLIENT_PY" tests/soak/soak.py --bin "$bin" --store "$work/store" --seconds "$seconds" \
  --clients "$clients" --queue "$queue" --max-rss-growth-mb "$growth" --log "$work/server.stderr" \
  ${SOAK_ACTIONS:+--actions "$SOAK_ACTIONS"} || status=$?
if [ "$status" -ne 0 ]; then
  echo "== last lines of the server log"
  tail -n 40 "$work/server.stderr" || true
fi
exit "$status"
