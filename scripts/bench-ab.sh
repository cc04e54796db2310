#!/usr/bin/env bash
# A/B of two release binaries on this machine (BENCHMARKS.md section 6): a change that must not
# move the benchmarks is checked here, interleaved so drift hits both sides alike.
#   OLD=path/to/old/deltafin NEW=target/release/deltafin RUNS=10 bash scripts/bench-ab.sh OUTDIR
# 1. `bench --kernels --json` RUNS times each, alternating (each run carries its own roofs);
# 2. on the k3-small fixture, RUNS/2 generate runs each with the spine resident and with all but
#    two spine layers streamed: a 512-token prompt, then 128 greedy tokens (--ignore-eos);
# 3. the same prompt alone (--max-tokens 1), 2*RUNS runs each, alternating which goes first.
set -euo pipefail
cd "$(dirname "$0")/.."
old=${OLD:?set OLD to the baseline binary}
new=${NEW:-target/release/deltafin}
runs=${RUNS:-10}
out=${1:?output directory}
mkdir -p "$out"
store=$(mktemp -d)
trap 'rm -rf "$store"' EXIT
"$new" convert --from fixtures/k3-small/hf --to "$store/st" --spine int8 >/dev/null
prompt=$(seq 0 511 | awk '{printf "%s%d", (NR > 1 ? "," : ""), ($1 * 37) % 500 + 10}')
bin() { if [ "$1" = old ]; then echo "$old"; else echo "$new"; fi; }

for i in $(seq "$runs"); do
  for tag in old new; do "$(bin $tag)" bench --kernels --json >"$out/kernels-$tag-$i.json" 2>/dev/null; done
done
for i in $(seq $((runs / 2))); do
  for tag in old new; do
    "$(bin $tag)" generate --model "$store/st" --prompt-tokens "$prompt" --max-tokens 128 --ignore-eos --json \
      2>/dev/null >"$out/engine-$tag-resident-$i.json"
    "$(bin $tag)" generate --model "$store/st" --prompt-tokens "$prompt" --max-tokens 128 --ignore-eos --json \
      --resident-spine-layers 2 2>/dev/null >"$out/engine-$tag-streamed-$i.json"
  done
done
: >"$out/prompt512.txt"
for i in $(seq $((2 * runs))); do
  if [ $((i % 2)) = 0 ]; then order="old new"; else order="new old"; fi
  for tag in $order; do
    "$(bin $tag)" generate --model "$store/st" --prompt-tokens "$prompt" --max-tokens 1 --json 2>/dev/null |
      grep -o '"prompt_s":[0-9.e-]*' | awk -F: -v t="$tag" '{printf "%s %.3f\n", t, $2 * 1000}' >>"$out/prompt512.txt"
  done
done
python3 - "$out" <<'EOF'
import glob, json, statistics as st, sys
out = sys.argv[1]
def med(v): return f"{st.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]"
runs = {t: [json.load(open(f)) for f in sorted(glob.glob(f"{out}/kernels-{t}-*.json"))] for t in ("old", "new")}
print("memory roof GB/s: old", med([r["memory_gbps"] for r in runs["old"]]), "new", med([r["memory_gbps"] for r in runs["new"]]))
print("| kernel | threads | old GB/s | new GB/s | new/old |")
keys = [(k["name"], k["threads"]) for k in runs["old"][0]["kernels"]]
for key in keys:
    v = {t: [k["gbps"] for r in runs[t] for k in r["kernels"] if (k["name"], k["threads"]) == key] for t in runs}
    print(f"| {key[0]} | {key[1]} | {med(v['old'])} | {med(v['new'])} | {st.median(v['new']) / st.median(v['old']):.2f} |")
for mode in ("resident", "streamed"):
    for t in ("old", "new"):
        steps = []
        for f in sorted(glob.glob(f"{out}/engine-{t}-{mode}-*.json")):
            s = json.load(open(f))["timing"]["decode_step_s"][1:]
            steps.append(st.median(s) * 1000)
        print(f"decode step, spine {mode}, {t}: median of run medians {med(steps)} ms")
p = {}
for line in open(f"{out}/prompt512.txt"):
    t, v = line.split()
    p.setdefault(t, []).append(float(v))
print(f"512-token prompt: old {med(p['old'])} ms, new {med(p['new'])} ms, new/old {st.median(p['new']) / st.median(p['old']):.3f}")
EOF
