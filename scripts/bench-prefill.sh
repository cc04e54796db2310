#!/usr/bin/env bash
# Reproduce BENCHMARKS.md section 9 (issue 12): time to first token against its floor for
# prompts of 100, 1,000 and 4,000 tokens (chunks sized from the budget; chunks of 32 with CHUNK32=1),
# and decode with the spine streamed, on a K3-shaped store larger than this machine's RAM with
# K3's real per-layer spine. Results land in bench-results/prefill-*.json.
#   BENCH_DIR   where the store is written (default /work/bench; 26 GB)
#   EXPERTS     experts per layer (default 640: 22.5 GB of experts, 26 GB with the spine;
#               896 needs 35 GB free)
#   RUNS        runs per configuration (default 3)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${BENCH_DIR:-/work/bench}
experts=${EXPERTS:-640}
runs=${RUNS:-3}
bin=${DELTAFIN_BIN:-target/release/deltafin}
[ -n "${DELTAFIN_BIN:-}" ] || cargo build --release --locked -q
store="$dir/k3-real2-$experts"
mkdir -p "$dir" bench-results
[ -f "$store/manifest.json" ] || $bin synth --preset kimi-k3 --layers 2 --experts "$experts" --spine real --out "$store"
# 1. TTFT with chunks sized from the budget (6 GiB), and the whole 1,000-token prompt in one.
$bin bench --model "$store" --memory-budget 6G --runs "$runs" --max-tokens 3 --no-prefetch --prompt-length 100 \
  --json > bench-results/prefill-ttft-100.json
$bin bench --model "$store" --memory-budget 6G --runs "$runs" --max-tokens 3 --no-prefetch --prompt-length 1000 \
  --vary prefill-chunk=auto,1000 --json > bench-results/prefill-ttft-1000.json
$bin bench --model "$store" --memory-budget 6G --runs 1 --max-tokens 3 --no-prefetch --prompt-length 4000 \
  --json > bench-results/prefill-ttft-4000.json
# With CHUNK32=1, also chunks of 32 tokens, as prompts ran before issue 12 (the 4,000-token run
# alone took 8.6 minutes at commit 3956d88).
if [ -n "${CHUNK32:-}" ]; then
  for n in 100 1000 4000; do
    $bin bench --model "$store" --memory-budget 6G --runs 1 --max-tokens 3 --no-prefetch --prompt-length "$n" \
      --prefill-chunk 32 --json > "bench-results/prefill-ttft-$n-chunk32.json"
  done
fi
# 2. Decode with every spine layer streamed against resident (same 6 GiB budget), and streamed
#    at 4.5 GiB (close to the minimum: embeddings, head, two layer images, buffers).
$bin bench --model "$store" --memory-budget 6G --runs "$runs" --max-tokens 8 --no-prefetch --probe-reads 64 \
  --vary resident-spine-layers=2,0 --json > bench-results/prefill-decode-streamed-spine.json
$bin bench --model "$store" --memory-budget 4.5G --resident-spine-layers 0 --runs "$runs" --max-tokens 8 --no-prefetch \
  --probe-reads 64 --json > bench-results/prefill-decode-streamed-spine-4.5g.json
