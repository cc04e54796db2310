#!/usr/bin/env bash
# Reproduce BENCHMARKS.md section 10 (issue 15): time to first token of a follow-up turn after a
# 2,000-token conversation with the prompt-state store and without it, snapshot sizes and their
# write and read times, and two interleaved conversations through the server.
#   1. `generate`, one fresh process per run (so a resumed run is "after a restart": its state
#      comes from disk): the conversation C (2,000 tokens) with --state-dir, then C + a 50-token
#      follow-up F without the store and with it. On the fixture k3-small and on a K3-shaped
#      synthetic store (4 layers of K3's real geometry: 3 KDA and 1 MLA, 64 experts).
#   2. `serve` on k3-small, with and without --state-dir: conversations A and B (2,000 tokens
#      each) interleaved, then each one's follow-up, the time of each request (curl, one token).
# Results: bench-results/states/*.json and a summary on stdout.
#   BENCH_DIR where the synthetic store is written (default /work/bench; about 10 GB)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${BENCH_DIR:-/work/bench}
bin=${DELTAFIN_BIN:-target/release/deltafin}
[ -n "${DELTAFIN_BIN:-}" ] || cargo build --release --locked -q
out=bench-results/states
mkdir -p "$out" "$dir"
work=$(mktemp -d)
trap 'rm -rf "$work"; [ -n "${srv:-}" ] && kill "$srv" 2>/dev/null || true' EXIT

# N token ids from a seed, comma separated (ids 3..252: inside every store's vocabulary).
ids() { awk -v n="$1" -v s="$2" 'BEGIN { for (i = 0; i < n; i++) printf "%s%d", (i ? "," : ""), (i * 37 + s * 101 + int(i / 7) * 13) % 250 + 3 }'; }
C=$(ids 2000 1)
CF="$C,$(ids 50 2)"

fixture="$work/k3-small"
$bin convert --from fixtures/k3-small/hf --to "$fixture" --spine int8 >/dev/null 2>&1
synth="$dir/k3-real4-64"
[ -f "$synth/manifest.json" ] || $bin synth --preset kimi-k3 --layers 4 --experts 64 --spine real --out "$synth" >&2

for model in fixture synth; do
  store=${!model}
  states="$work/states-$model"
  rm -rf "$states"
  echo "== $model: the conversation, stored" >&2
  $bin generate --model "$store" --prompt-tokens "$C" --max-tokens 3 --ignore-eos --json --state-dir "$states" \
    > "$out/$model-first.json" 2>/dev/null
  echo "== $model: the follow-up without the store" >&2
  $bin generate --model "$store" --prompt-tokens "$CF" --max-tokens 3 --ignore-eos --json > "$out/$model-scratch.json" 2>/dev/null
  echo "== $model: the follow-up from the store, in a new process" >&2
  $bin generate --model "$store" --prompt-tokens "$CF" --max-tokens 3 --ignore-eos --json --state-dir "$states" \
    > "$out/$model-resumed.json" 2>/dev/null
  ls -l "$states" > "$out/$model-snapshots.txt"
done

# The server: A and B interleaved, each follow-up timed.
serve_run() { # $1 = label, rest = extra serve args
  local label=$1
  shift
  local port=18437
  $bin serve --model "$fixture" --port $port "$@" 2>"$work/serve-$label.log" &
  srv=$!
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && break; sleep 0.1; done
  local a b
  a=$(ids 2000 3)
  b=$(ids 2000 4)
  : > "$out/serve-$label.txt"
  for step in "A:$a" "B:$b" "A+:$a,$(ids 50 5)" "B+:$b,$(ids 50 6)" "A++:$a,$(ids 50 5),$(ids 50 7)"; do
    local name=${step%%:*} prompt=${step#*:}
    local t
    t=$(curl -s -o "$work/resp.json" -w '%{time_total}' "http://127.0.0.1:$port/v1/completions" \
      -H 'content-type: application/json' \
      -d "{\"model\":\"k3-small\",\"prompt\":[$prompt],\"max_tokens\":1,\"temperature\":0}")
    local cached
    cached=$(sed -n 's/.*"cached_tokens":\([0-9]*\).*/\1/p' "$work/resp.json")
    echo "$name $t s cached_tokens=${cached:-?}" | tee -a "$out/serve-$label.txt" >&2
  done
  curl -s "http://127.0.0.1:$port/metrics" | grep '^deltafin_state' >> "$out/serve-$label.txt" || true
  kill $srv
  wait $srv 2>/dev/null || true
  srv=""
}
serve_run without
serve_run with --state-dir "$work/serve-states"

echo "results in $out" >&2
