#!/usr/bin/env bash
# Reproduce the figures in BENCHMARKS.md on this machine: K3-geometry stores written by
# `deltafin synth` (31 GB and 9 GB; they are left in $BENCH_DIR), then interleaved benchmark runs,
# each paired with raw O_DIRECT probes of the same drive. Results land in bench-results/.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${BENCH_DIR:-/work/bench}
bin=target/release/deltafin
cargo build --release --locked -q
mkdir -p "$dir" bench-results
# 1. Expert streaming at K3 scale: 2 layers x 896 experts (31.4 GB, more than this machine's RAM).
[ -f "$dir/k3-2l/manifest.json" ] || $bin synth --preset kimi-k3 --layers 2 --out "$dir/k3-2l"
$bin bench --model "$dir/k3-2l" --memory-budget 2G --runs 5 --no-prefetch \
  --vary io-backend=io-uring,pread --json > bench-results/experts-cold-backends.json
$bin bench --model "$dir/k3-2l" --memory-budget 4G --runs 5 --max-tokens 8 --no-prefetch \
  --routing-locality 0.6 --vary cache-policy=lru,slru --json > bench-results/experts-locality-policies.json
# 2. K3's real per-layer spine (4 layers, 64 experts each): resident versus streamed spine.
[ -f "$dir/k3-real4/manifest.json" ] || $bin synth --preset kimi-k3 --layers 4 --experts 64 --spine real --out "$dir/k3-real4"
$bin bench --model "$dir/k3-real4" --runs 5 --max-tokens 4 --no-prefetch --probe-reads 64 --memory-budget 6G \
  --vary resident-spine-layers=4,0 --json > bench-results/spine-resident-vs-streamed.json
