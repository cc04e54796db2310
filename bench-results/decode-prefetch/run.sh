#!/usr/bin/env bash
# A/B of decode at a context on k3-real4 (KDA x3 + MLA, everything in memory), two builds
# interleaved in fresh processes. Usage:
#   BEFORE=<build> AFTER=<build> STORE=/work/bench/k3-real4 OUT=bench-results/decode-prefetch \
#   RUNS=3 TOKENS=24 bash bench-results/decode-prefetch/run.sh 2000 16000
set -euo pipefail
OUT=${OUT:-bench-results/decode-prefetch}
RUNS=${RUNS:-3}
TOKENS=${TOKENS:-24}
for n in "$@"; do
  for r in $(seq 1 "$RUNS"); do
    for side in before after; do
      bin=$BEFORE; [ "$side" = after ] && bin=$AFTER
      f="$OUT/decode-$n-$side-run$r.json"
      "$bin" bench --model "$STORE" --context-fill "$n" --warm --memory-budget 12G --runs 1 --no-prefetch \
        --probe-reads 64 --json --max-tokens "$TOKENS" > "$f"
      python3 - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{sys.argv[1]}: {d['s_per_token']:.3f} s/token at context {d['decode_context']} (floor {d['floor_s_per_token']:.3f}: "
      f"mem {d['floor_memory_s_per_token']:.3f} compute {d['floor_compute_s_per_token']:.3f}; {d['memory_gbps']:.1f} GB/s, "
      f"{d['peak_gflops']:.0f} GFLOP/s) x{d['s_per_token'] / d['floor_s_per_token']:.2f}", flush=True)
PY
    done
  done
done
