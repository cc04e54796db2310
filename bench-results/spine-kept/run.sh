#!/usr/bin/env bash
# Issue 24 item 4: a streamed spine layer kept between reads (no decode, no allocation per token)
# against decoding it for every token. Decode with the whole spine streamed, fresh processes,
# binaries interleaved (A B A B ...).
# Usage: BEFORE=<old binary> AFTER=<new binary> STORE=/work/bench/k3-real4 RUNS=3 \
#        OUT=bench-results/spine-kept bash bench-results/spine-kept/run.sh
set -euo pipefail
STORE=${STORE:-/work/bench/k3-real4}
OUT=${OUT:-bench-results/spine-kept}
RUNS=${RUNS:-3}
args=(--model "$STORE" --memory-budget 6G --resident-spine-layers 0 --runs 1 --max-tokens 12 --json)
for r in $(seq 1 "$RUNS"); do
  "$BEFORE" bench "${args[@]}" > "$OUT/before-run$r.json"
  "$AFTER" bench "${args[@]}" > "$OUT/after-run$r.json"
done
