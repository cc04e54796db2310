#!/usr/bin/env bash
# Decode speed of the demo model with an int8 and a bf16 spine (what `convert --spine auto` picks
# where it fits), in alternating fresh processes, against the memory-read roof measured in the
# same run. Prints medians and ranges; raw lines land in bench-results/spine-dtype/.
#   RUNS    runs per dtype (default 7)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${DELTAFIN_BIN:-target/release/deltafin}
[ -n "${DELTAFIN_BIN:-}" ] || cargo build --release --locked
runs=${RUNS:-7}
out=bench-results/spine-dtype
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$out"
for d in int8 bf16; do
  $bin convert --from models/k3-demo/hf --to "$tmp/$d" --spine "$d" 2>/dev/null
done
: > "$out/runs.txt"
for i in $(seq "$runs"); do
  for d in int8 bf16; do
    rate=$($bin generate --model "$tmp/$d" --prompt "To read a file in Python," --max-tokens 200 --ignore-eos 2>&1 |
      sed -nE 's/.*decode ([0-9.]+) tok\/s.*/\1/p')
    echo "$d $rate" | tee -a "$out/runs.txt"
  done
done
$bin bench --kernels --kernel-seconds 1 --json > "$out/kernels.json"
python3 - "$out" "$tmp" <<'EOF'
import json, statistics, sys
out, tmp = sys.argv[1], sys.argv[2]
rates = {}
for line in open(f"{out}/runs.txt"):
    d, r = line.split()
    rates.setdefault(d, []).append(float(r))
k = json.load(open(f"{out}/kernels.json"))
mem = k["memory_gbps"]
summary = {"memory_read_gbps": mem, "kernel_path": k["kernel_path"], "dtypes": {}}
for d, rs in rates.items():
    spine = json.load(open(f"{tmp}/{d}/manifest.json"))["spine"]["bytes"]
    med = statistics.median(rs)
    # The spine is read once per token: its bytes over the memory roof bound the rate from above.
    roof = mem * 1e9 / spine
    summary["dtypes"][d] = {"median_tok_s": med, "min": min(rs), "max": max(rs), "spine_bytes": spine,
                            "spine_roof_tok_s": roof}
    print(f"{d}: decode {med:.0f} tok/s (median of {len(rs)}, {min(rs):.0f}-{max(rs):.0f}); spine {spine / 1e6:.1f} MB, "
          f"whose read at {mem:.1f} GB/s bounds it at {roof:.0f} tok/s")
r = statistics.median(rates["bf16"]) / statistics.median(rates["int8"])
summary["bf16_over_int8"] = r
print(f"bf16 / int8 decode rate: {r:.2f}")
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
EOF
