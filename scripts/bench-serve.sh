#!/usr/bin/env bash
# Serving measurements on the k3-small fixture (BENCHMARKS.md section 5):
#  1. per-token cost of the HTTP path: 128 streamed greedy tokens, 5 runs after a warm-up;
#  2. a chat's second turn with and without the prefix snapshot (5 runs each).
# Needs a release build (cargo build --release) and curl.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/deltafin
store=${STORE:-target/bench-st-small}
port=${PORT:-8770}
[ -d "$store" ] || "$bin" convert --from fixtures/k3-small/hf --to "$store" --spine int8 >/dev/null
url=http://127.0.0.1:$port/v1

start() {
  "$bin" serve --model "$store" --port "$port" --served-model-name s "$@" >/dev/null 2>&1 &
  pid=$!
  for _ in $(seq 50); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && return; sleep 0.1; done
  echo "server did not start" >&2; exit 1
}
stop() { kill "$pid"; wait "$pid" 2>/dev/null || true; }

echo "== engine alone: decode step (ms), 5 fresh processes"
for _ in 1 2 3 4 5; do
  "$bin" generate --model "$store" --prompt "The lighthouse keeper" --max-tokens 128 --ignore-eos --json 2>/dev/null |
    grep -o '"decode_step_s":\[[^]]*\]' | tr -d '"a-z_:[]' | tr ',' '\n' | sort -g | awk '{v[NR]=$1} END {printf "median step %.3f ms\n", v[int((NR+1)/2)]*1000}'
done

echo "== through the server: 128 streamed tokens, whole request / 128 (ms)"
start
body='{"model":"s","prompt":"The lighthouse keeper","max_tokens":128,"temperature":0,"ignore_eos":true,"stream":true}'
curl -s -o /dev/null "$url/completions" -d "$body"
for _ in 1 2 3 4 5; do
  curl -s -o /dev/null -w "%{time_total}\n" -N "$url/completions" -d "$body" | awk '{printf "%.3f ms per token\n", $1/128*1000}'
done
curl -s "http://127.0.0.1:$port/metrics" | grep -E '^deltafin_seconds_per_token_(sum|count)'
stop

long=$(printf 'The lighthouse keeper counted the boats in the harbour. %.0s' $(seq 60))
turn1=$(printf '{"model":"s","max_tokens":1,"temperature":0,"messages":[{"role":"user","content":"%s"}]}' "$long")
turn2=$(printf '{"model":"s","max_tokens":1,"temperature":0,"messages":[{"role":"user","content":"%s"},{"role":"assistant","content":"ok"},{"role":"user","content":"And the boats?"}]}' "$long")
for mode in prefix-cache no-prefix-cache; do
  echo "== second chat turn, $mode: whole request (ms)"
  if [ $mode = no-prefix-cache ]; then start --no-prefix-cache; else start; fi
  for _ in 1 2 3 4 5; do
    curl -s -o /dev/null "$url/chat/completions" -d "$turn1"
    curl -s -o /dev/null -w "%{time_total}\n" "$url/chat/completions" -d "$turn2" | awk '{printf "%.1f ms\n", $1*1000}'
  done
  curl -s "http://127.0.0.1:$port/metrics" | grep -E '^deltafin_prompt_tokens(_cached)?_total'
  stop
done
