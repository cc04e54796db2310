#!/usr/bin/env bash
# Continuous batching with an MLA layer at long contexts (issue 27; BENCHMARKS.md section 15):
# k3-real4 (synth --preset kimi-k3 --layers 4 --experts 64 --spine real: KDA, KDA, KDA, MLA).
# BIN=target/release/deltafin STORE=/work/bench/k3-real4 bash bench-results/streams-mla/run.sh [streamed] [resident]
# Tables: python3 bench-results/streams-mla/summarize.py bench-results/streams-mla/*.json
set -euo pipefail
BIN=${BIN:-target/release/deltafin}
STORE=${STORE:-/work/bench/k3-real4}
OUT=${OUT:-bench-results/streams-mla}
[ $# -gt 0 ] || set -- streamed resident
for what in "$@"; do
  case $what in
    # Spine streamed at a 6 GiB budget, every stream at a context of 4,000.
    streamed) "$BIN" bench --model "$STORE" --memory-budget 6G --resident-spine-layers 0 --runs 2 --max-tokens 8 \
      --streams 1,2,4 --context-fill 4000 --json > "$OUT/k3-real4-streamed-ctx4000.json" 2> "$OUT/k3-real4-streamed-ctx4000.log" ;;
    # Everything in memory (12 GiB), every stream at a context of 16,000: attention per stream.
    resident) "$BIN" bench --model "$STORE" --memory-budget 12G --runs 2 --max-tokens 8 \
      --streams 1,2,4 --context-fill 16000 --json > "$OUT/k3-real4-resident-ctx16000.json" 2> "$OUT/k3-real4-resident-ctx16000.log" ;;
    *) echo "unknown run '$what' (streamed, resident)" >&2; exit 2 ;;
  esac
done
