#!/usr/bin/env bash
# Issue 24, item 4: time to first token of a 2,000-token prompt before and after scratch
# buffers stopped being zero-filled (`Scratch::take` leaves contents; `take_zeroed` clears), on
# k3-real4 (`deltafin synth --layers 4 --experts 64 --spine real`: 3 KDA + 1 MLA layer, every
# expert fits the budget), fresh process per run, the two binaries interleaved.
#   BEFORE=... AFTER=... STORE=/work/bench/k3-real4 OUT=bench-results/scratch-fill RUNS=2 bash run.sh
set -euo pipefail
: "${BEFORE:?}" "${AFTER:?}" "${STORE:?}" "${OUT:?}"
RUNS=${RUNS:-2}
N=${N:-2000}
mkdir -p "$OUT"
for i in $(seq 1 "$RUNS"); do
  for which in before after; do
    bin=$BEFORE; [ "$which" = after ] && bin=$AFTER
    "$bin" bench --model "$STORE" --prompt-length "$N" --memory-budget 12G --runs 1 --no-prefetch \
      --probe-reads 64 --max-tokens 4 --json > "$OUT/$which-ttft$N-run$i.json" 2>> "$OUT/log.txt"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], 'ttft', round(d['ttft_s'],2), 'floor', round(d['ttft_floor_s'],2), 'peak_rss', d['peak_rss_bytes'])" "$OUT/$which-ttft$N-run$i.json"
  done
done
