#!/usr/bin/env bash
# A long prompt through the continuous batcher with nobody decoding beside it (issue 27): it
# borrows the expert cache for larger chunks, as alone. BENCHMARKS.md section 15.
# BEFORE=<build of 048fb40> AFTER=target/release/deltafin bash bench-results/batch-borrow/run.sh
# Stores: synth --preset kimi-k3 --layers 4 --experts 64 --spine real --out /work/bench/k3-real4
#         synth --preset kimi-k3 --layers 2 --experts 896 --spine real --out /work/bench/k3-2r
set -euo pipefail
BEFORE=${BEFORE:?a build without prompt borrowing in the batcher}
AFTER=${AFTER:-target/release/deltafin}
O=${OUT:-bench-results/batch-borrow}
for store in k3-real4:4000 k3-2r:2000; do
  name=${store%%:*} len=${store##*:}
  A="--model /work/bench/$name --memory-budget 6G --resident-spine-layers 0 --runs 1 --prompt-length $len --max-tokens 3 --json"
  pre=$([ "$name" = k3-real4 ] && echo "" || echo "$name-")
  "$AFTER" bench $A --streams 1 > "$O/${pre}after-streams1.json" 2> "$O/${pre}after-streams1.log"
  "$BEFORE" bench $A --streams 1 > "$O/${pre}before-streams1.json" 2> "$O/${pre}before-streams1.log"
  "$AFTER" bench $A > "$O/${pre}solo.json" 2> "$O/${pre}solo.log"
done
