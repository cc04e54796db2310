#!/usr/bin/env bash
# A/B of two deltafin builds on the 2-layer x 896-expert store with K3's real spine
# (`deltafin synth --layers 2 --experts 896 --spine real`), 6 GiB budget, prefetch off, spine
# resident (2 layers) and streamed (0). Fresh process per run, binaries and configurations
# interleaved: before/after x resident/streamed, RUNS rounds. Used for issue 24's I/O thread
# (item 1, OUT=bench-results/io-thread) and its huge-page I/O buffers
# (OUT=bench-results/huge-pages; table: python3 bench-results/huge-pages/summarize.py DIR).
#   BEFORE=... AFTER=... STORE=/work/bench/k3-2r OUT=bench-results/io-thread RUNS=5 bash run.sh
set -euo pipefail
: "${BEFORE:?}" "${AFTER:?}" "${STORE:?}" "${OUT:?}"
RUNS=${RUNS:-5}
mkdir -p "$OUT"
for i in $(seq 1 "$RUNS"); do
  for spine in 2 0; do
    for which in before after; do
      bin=$BEFORE; [ "$which" = after ] && bin=$AFTER
      "$bin" bench --model "$STORE" --memory-budget 6G --runs 1 --max-tokens 8 \
        --resident-spine-layers "$spine" --json > "$OUT/$which-spine$spine-run$i.json" 2>> "$OUT/log.txt"
      echo "round $i spine $spine $which done" >&2
    done
  done
done
