#!/usr/bin/env bash
# Issue 23's benchmarks: time to first token and decode at a context, on k3-real4 (layers 0-2
# KDA, layer 3 MLA) beside k3-real3 (KDA only), fresh processes, the two stores interleaved.
#   deltafin synth --preset kimi-k3 --layers 4 --experts 64 --spine real --out $STORES/k3-real4
#   deltafin synth --preset kimi-k3 --layers 3 --experts 64 --spine real --out $STORES/k3-real3
# Usage: BIN=target/release/deltafin STORES=/work/bench OUT=bench-results/mla-contexts \
#        bash bench-results/mla-contexts/run.sh ttft 1000 2000 4000 | decode 1000 4000 16000 32000
#   LAYERS="4": one store only; APPROX=1: with --approx (files named ...-approx-...)
set -euo pipefail
BIN=${BIN:-target/release/deltafin}
STORES=${STORES:-/work/bench}
OUT=${OUT:-bench-results/mla-contexts}
RUNS=${RUNS:-2}
LAYERS=${LAYERS:-3 4}
extra=(); tag=""
if [ "${APPROX:-0}" = 1 ]; then extra=(--approx); tag="-approx"; fi
mode=$1
shift
common=(--memory-budget 12G --runs 1 --no-prefetch --probe-reads 64 --json "${extra[@]}")
for n in "$@"; do
  for r in $(seq 1 "$RUNS"); do
    for layers in $LAYERS; do
      f="$OUT/$mode$tag-$n-real$layers-run$r.json"
      case $mode in
        ttft) "$BIN" bench --model "$STORES/k3-real$layers" --prompt-length "$n" "${common[@]}" --max-tokens 4 > "$f" ;;
        # Warm: the second generation of the process is measured, its experts in the cache (the
        # whole store fits in the budget): decode where everything is in memory.
        decode) "$BIN" bench --model "$STORES/k3-real$layers" --context-fill "$n" --warm "${common[@]}" --max-tokens 8 > "$f" ;;
      esac
      python3 "$(dirname "$0")/../run_line.py" "$f"
    done
  done
done
