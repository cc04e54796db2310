#!/usr/bin/env bash
# Decode in memory at a context of 2,000 tokens on k3-real4 (KDA x3 + MLA), warm (the second
# generation of the process is measured, its experts cached), two binaries interleaved.
# Usage: BEFORE=<build> AFTER=<build> STORE=/work/bench/k3-real4 RUNS=2 bash bench-results/avx2-gemm/decode/run.sh
set -euo pipefail
: "${BEFORE:?}" "${AFTER:?}" "${STORE:?}"
OUT=${OUT:-bench-results/avx2-gemm/decode}; RUNS=${RUNS:-2}
for r in $(seq 1 "$RUNS"); do
  for side in before after; do
    bin=$BEFORE; [ "$side" = after ] && bin=$AFTER
    "$bin" bench --model "$STORE" --memory-budget 12G --runs 1 --no-prefetch --context-fill 2000 --warm --max-tokens 8 --json \
      > "$OUT/decode-2000-$side-$r.json" 2> "$OUT/decode-2000-$side-$r.log"
    python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[2], 's/token %.3f floor %.3f (x%.2f) memory %.1f GB/s' % (d['s_per_token'], d['floor_s_per_token'], d['decode_vs_floor'], d['memory_gbps']), d['git_commit'])
" "$OUT/decode-2000-$side-$r.json" "$side"
  done
done
