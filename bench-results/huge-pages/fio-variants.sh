#!/usr/bin/env bash
# Replay one run's read log with fio variants, interleaved: plain O_DIRECT io_uring at depth 32
# and 64, and the same with registered buffers (--fixedbufs). The log:
#   deltafin generate --model /work/bench/k3-2r --memory-budget 6G --prompt-tokens 11,22,33,44,55 \
#     --max-tokens 8 --ignore-eos --no-prefetch --resident-spine-layers 2 --read-log /tmp/k3-2r-spine2.iolog --json
# Usage: bash fio-variants.sh LOG ROUNDS > fio-variants.txt
# (The huge-page row of BENCHMARKS.md section 14 ran it with
# /sys/kernel/mm/transparent_hugepage/enabled set to `always` for the run, then back to madvise.)
log=$1; rounds=${2:-3}
rate() { python3 -c '
import json,sys
t=sys.stdin.read(); v=json.loads(t[t.index("{"):]); r=v["jobs"][0]["read"]
print(round(float(sys.argv[1])/ (r["runtime"]/1e3) /1e9,3))' "$bytes"; }
bytes=$(awk '$2=="read"{s+=$4} END{print s}' "$log")
for i in $(seq 1 "$rounds"); do
  for v in plain fixed qd64 fixed64; do
    extra=""
    case $v in fixed) extra="--fixedbufs";; qd64) extra="";; fixed64) extra="--fixedbufs";; esac
    qd=32; [[ $v == *64 ]] && qd=64
    g=$(fio --name=r --read_iolog="$log" --ioengine=io_uring --direct=1 --replay_no_stall=1 --iodepth=$qd $extra --output-format=json 2>/dev/null | rate)
    echo "round $i $v qd$qd $g GB/s"
  done
done
