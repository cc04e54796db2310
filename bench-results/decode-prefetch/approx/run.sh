#!/usr/bin/env bash
# --approx decode at a context of 2,000 on k3-arch4 (section 13's model), two builds interleaved.
# Usage: BEFORE=<build> AFTER=<build> STORE=/work/bench/k3-arch4 OUT=bench-results/decode-prefetch/approx \
#        bash bench-results/decode-prefetch/approx/run.sh
set -euo pipefail
for r in 1 2; do for side in before after; do
  bin=$BEFORE; [ "$side" = after ] && bin=$AFTER
  "$bin" bench --model "$STORE" --memory-budget 12G --runs 1 --no-prefetch --probe-reads 64 --threads 2 --json \
    --context-fill 2000 --warm --max-tokens 16 --approx > "$OUT/decode-2000-approx-$side-$r.json"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], d['s_per_token'], d['memory_gbps'])" \
    "$OUT/decode-2000-approx-$side-$r.json"
done; done
