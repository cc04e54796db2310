#!/usr/bin/env bash
# A/B of two builds on one store, fresh processes, the builds interleaved (before, after, before,
# ...) so that the machine's drift hits both alike. Every run's JSON carries its own floor.
#   BEFORE=<build> AFTER=<build> STORE=/work/bench/k3-real4 OUT=<dir> RUNS=3 \
#   bash bench-results/ab-builds.sh decode 16000 2000 | ttft 1000
# decode N: `bench --context-fill N --warm --max-tokens $TOKENS` (default 24): the second
#   generation of the process, its experts cached, at a context of N synthetic positions.
# ttft N: `bench --prompt-length N --context N+100 --max-tokens 3`: a cold N-token prompt.
# EXTRA: more `bench` arguments for both sides (e.g. "--threads 2 --approx"); TAG: a file-name
# part for them. Files: $OUT/$mode-$N$TAG-{before,after}-run$r.json.
set -euo pipefail
OUT=${OUT:?set OUT}
RUNS=${RUNS:-3}
TOKENS=${TOKENS:-24}
read -r -a extra <<<"${EXTRA:-}"
mode=$1
shift
common=(--model "$STORE" --memory-budget 12G --runs 1 --no-prefetch --probe-reads 64 --json "${extra[@]}")
for n in "$@"; do
  for r in $(seq 1 "$RUNS"); do
    for side in before after; do
      bin=$BEFORE; [ "$side" = after ] && bin=$AFTER
      f="$OUT/$mode-$n${TAG:-}-$side-run$r.json"
      case $mode in
        decode) "$bin" bench "${common[@]}" --context-fill "$n" --warm --max-tokens "$TOKENS" > "$f" ;;
        ttft) "$bin" bench "${common[@]}" --prompt-length "$n" --context $((n + 100)) --max-tokens 3 > "$f" ;;
        *) echo "mode: decode or ttft" >&2; exit 2 ;;
      esac
      python3 "$(dirname "$0")/run_line.py" "$f"
    done
  done
done
