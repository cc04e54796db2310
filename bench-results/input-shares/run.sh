#!/usr/bin/env bash
# A/B of the time to first token, a 1,000-token prompt on k3-real4 (KDA x3 + MLA, in memory),
# two builds interleaved in fresh processes. Usage:
#   BEFORE=<build> AFTER=<build> STORE=/work/bench/k3-real4 OUT=bench-results/input-shares RUNS=3 \
#   LEN=1000 bash bench-results/input-shares/run.sh
set -euo pipefail
OUT=${OUT:-bench-results/input-shares}
RUNS=${RUNS:-3}
LEN=${LEN:-1000}
for r in $(seq 1 "$RUNS"); do
  for side in before after; do
    bin=$BEFORE; [ "$side" = after ] && bin=$AFTER
    f="$OUT/ttft-$LEN-$side-run$r.json"
    "$bin" bench --model "$STORE" --memory-budget 12G --runs 1 --no-prefetch --probe-reads 64 \
      --prompt-length "$LEN" --context $((LEN + 100)) --max-tokens 3 --json > "$f"
    python3 - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{sys.argv[1]}: ttft {d['ttft_s']:.2f} s, floor {d['ttft_floor_s']:.2f} s (x{d['ttft_s'] / d['ttft_floor_s']:.2f}; "
      f"{d['prefill_flops'] / 1e12:.2f} TFLOP at {d['peak_gflops']:.0f} GFLOP/s), attention {d['prefill_attention_s']:.1f} s, "
      f"feed-forward {d['prefill_ffn_s']:.1f} s, commit {d['git_commit']}", flush=True)
PY
  done
done
