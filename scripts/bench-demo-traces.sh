#!/usr/bin/env bash
# Reproduce docs/streaming.md's "Traces of a trained router" replay: the trained demo model's router traces
# (models/k3-demo/traces, with their look-ahead predictions) drive a K3-shaped synthetic store of
# 7 MoE layers x 64 experts (17.5 MB records, 7.9 GB), decoding with prefetch off and on at three
# cache sizes, and LRU against SLRU. Results land in bench-results/demo-traces-replay/.
#   BENCH_DIR  where the store is written (default /work/bench; 7.9 GB)
#   LONG=1     the long replay instead: 60 consecutive tokens from the middle of each of the five
#              traces (300 in all, the kind changing every 60 as a server's topics would), 295
#              decoded per run; results in bench-results/demo-traces-replay-long/
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${BENCH_DIR:-/work/bench}
bin=${DELTAFIN_BIN:-target/release/deltafin}
[ -n "${DELTAFIN_BIN:-}" ] || cargo build --release --locked -q
store="$dir/k3-7x64"
out=bench-results/demo-traces-replay
tokens=40
[ -z "${LONG:-}" ] || { out=bench-results/demo-traces-replay-long; tokens=295; }
mkdir -p "$dir" "$out"
[ -f "$store/manifest.json" ] || $bin synth --preset kimi-k3 --layers 7 --experts 64 --out "$store"
# One trace file: the five traces back to back, each its own sequence.
trace="$dir/all-traces.jsonl"
head -n 1 models/k3-demo/traces/prose.jsonl > "$trace"
seq=0
for k in prose code rust mixed chat; do
  if [ -n "${LONG:-}" ]; then rows() { sed -n 202,261p; }; else rows() { tail -n +2; }; fi
  rows < "models/k3-demo/traces/$k.jsonl" | sed -E "s/^\{\"seq\":[0-9]+/{\"seq\":$seq/" >> "$trace"
  seq=$((seq + 1))
done
for m in 2.12G 3.1G 5.1G; do
  $bin bench --model "$store" --memory-budget "$m" --runs 2 --max-tokens $tokens --routing-trace "$trace" \
    --vary prefetch=off,on --json > "$out/tb-$m.json"
done
$bin bench --model "$store" --memory-budget 3.1G --runs 2 --max-tokens $tokens --routing-trace "$trace" \
  --vary cache-policy=lru,slru --json > "$out/tb-policy.json"
