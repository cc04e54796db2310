#!/usr/bin/env bash
# Reproduce BENCHMARKS.md section 9's verification cost: what hashing every expert record read
# costs a decode step, measured step against neighbouring step inside one process, where the
# drive's drift between processes (often more than 10% here) cancels. A build with the
# `measure-verify` feature skips the hash on every other decode step when DELTAFIN_MEASURE_VERIFY
# is set; each skipped step is compared with the mean of its two verified neighbours, per byte
# read. The issue's store (K3's real spine, 640 experts, 26 GB), 6 GiB, prefetch off.
#   BENCH_DIR  where the store is written (default /work/bench)   RUNS  runs (default 3)
#   STEPS      decode steps per run (default 40)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${BENCH_DIR:-/work/bench}
runs=${RUNS:-3}
steps=${STEPS:-40}
echo "building with --features deltafin/measure-verify into target/measure-verify (a first build takes minutes)" >&2
cargo build --release --locked -q --features deltafin/measure-verify --target-dir target/measure-verify
bin=target/measure-verify/release/deltafin
store="$dir/k3-real2-640"
mkdir -p "$dir" bench-results/verify-alternating
[ -f "$store/manifest.json" ] || $bin synth --preset kimi-k3 --layers 2 --experts 640 --spine real --out "$store"
for i in $(seq "$runs"); do
  echo "run $i/$runs" >&2
  DELTAFIN_MEASURE_VERIFY=1 $bin bench --model "$store" --memory-budget 6G --runs 1 --max-tokens $((steps + 1)) \
    --no-prefetch --json > "bench-results/verify-alternating/run-$i.json"
done
python3 - bench-results/verify-alternating <<'PY'
import glob, json, statistics as st, sys
ratios, rows = [], []
for f in sorted(glob.glob(f"{sys.argv[1]}/run-*.json")):
    t = json.load(open(f))["per_run"][0]["run"]["timing"]
    per_byte = [s / b for s, b in zip(t["decode_step_s"], t["decode_step_bytes"])]
    # Even steps verify, odd ones skip the hash: each odd step against its neighbours' mean.
    r = [(per_byte[i - 1] + per_byte[i + 1]) / 2 / per_byte[i] for i in range(1, len(per_byte) - 1, 2)]
    ratios += r
    rows.append({"file": f, "pairs": len(r), "median": st.median(r),
                 "verified_step_s": st.median(t["decode_step_s"][0::2]),
                 "skipped_step_s": st.median(t["decode_step_s"][1::2])})
    print(f"{f}: {len(r)} pairs, verified/skipped per byte median {st.median(r):.3f}; steps "
          f"{rows[-1]['verified_step_s']:.3f} s verified, {rows[-1]['skipped_step_s']:.3f} s skipped")
q = sorted(ratios)
n = len(q)
summary = {"pairs": n, "median": st.median(q), "q1": q[n // 4], "q3": q[3 * n // 4], "runs": rows}
print(f"verification costs {100 * (summary['median'] - 1):.1f}% of a decode step per byte read "
      f"(median of {n} pairs, quartiles {100 * (summary['q1'] - 1):+.1f}% to {100 * (summary['q3'] - 1):+.1f}%)")
json.dump(summary, open(f"{sys.argv[1]}/summary.json", "w"), indent=2)
PY
