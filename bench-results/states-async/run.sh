#!/usr/bin/env bash
# Issue 24 item 3: time to first token with and without --state-dir, the snapshot written on the
# engine thread (OLD binary) against a writer thread (NEW), on k3-arch4 (tools/k3_arch_checkpoint.py,
# converted with --spine int8), a 256-token prompt in chunks of 64 (a snapshot after each chunk
# and after the prompt), fresh processes, interleaved. Usage:
#   OLD=... NEW=target/release/deltafin STORE=/work/bench/k3-arch4 OUT=bench-results/states-async RUNS=3 bash run.sh
set -euo pipefail
OUT=${OUT:-bench-results/states-async}
RUNS=${RUNS:-3}
ids=$(python3 -c "print(','.join(str((i * 7919) % 160000 + 11) for i in range(256)))")
common=(--model "$STORE" --prompt-tokens "$ids" --max-tokens 2 --prefill-chunk 64 --memory-budget 12G --threads 2 --json)
for r in $(seq 1 "$RUNS"); do
  for cfg in old-states new-states new-none; do
    d=$(mktemp -d)
    case $cfg in
      old-states) "$OLD" generate "${common[@]}" --state-dir "$d" > "$OUT/$cfg-run$r.json" 2>/dev/null ;;
      new-states) "$NEW" generate "${common[@]}" --state-dir "$d" > "$OUT/$cfg-run$r.json" 2>/dev/null ;;
      new-none) "$NEW" generate "${common[@]}" > "$OUT/$cfg-run$r.json" 2>/dev/null ;;
    esac
    rm -rf "$d"
    python3 -c "
import json,sys; d=json.load(open('$OUT/$cfg-run$r.json')); t=d['timing']
ps=d.get('prompt_states') or {}
print('$cfg run $r', {k: t[k] for k in t if 'first' in k or k in ('prompt_s','ttft_s')}, ps.get('counters'))"
  done
done
