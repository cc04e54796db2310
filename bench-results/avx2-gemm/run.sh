#!/usr/bin/env bash
# A/B of the AVX2 cache-blocked prompt products: time to first token of a prompt on a store with
# an MLA layer, everything in memory (compute-bound), fresh processes, binaries interleaved.
# Usage: BEFORE=<build of the parent commit> AFTER=<build with the change> STORE=/work/bench/k3-real4 \
#        OUT=bench-results/avx2-gemm RUNS=2 LEN=1000 BUDGET=12G bash bench-results/avx2-gemm/run.sh
set -euo pipefail
: "${BEFORE:?}" "${AFTER:?}" "${STORE:?}"
OUT=${OUT:-bench-results/avx2-gemm}; RUNS=${RUNS:-2}; LEN=${LEN:-1000}; BUDGET=${BUDGET:-12G}
EXTRA=${EXTRA:-}
mkdir -p "$OUT"
for r in $(seq 1 "$RUNS"); do
  for side in before after; do
    bin=$BEFORE; [ "$side" = after ] && bin=$AFTER
    "$bin" bench --model "$STORE" --memory-budget "$BUDGET" --runs 1 --prompt-length "$LEN" --max-tokens 3 $EXTRA --json \
      > "$OUT/ttft-$LEN-$side-$r.json" 2> "$OUT/ttft-$LEN-$side-$r.log"
    python3 - "$OUT/ttft-$LEN-$side-$r.json" "$side" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[2], json.dumps({k: d.get(k) for k in ("ttft_s", "ttft_floor_s", "ttft_vs_floor", "git_commit")}),
      "peak GFLOP/s", d["ranges"]["peak_gflops"])
PY
  done
done
