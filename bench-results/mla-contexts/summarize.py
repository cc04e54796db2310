#!/usr/bin/env python3
"""Tables of bench-results/mla-contexts/*.json (made by run.sh): medians over runs, ranges, floors and ratios."""
import glob, json, os, re, statistics, sys
from collections import defaultdict

here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
rows = defaultdict(list)
for f in sorted(glob.glob(os.path.join(here, "*.json"))):
    m = re.match(r"(ttft|decode|decode-approx)-(\d+)-real(\d)-run\d+\.json", os.path.basename(f))
    if m and os.path.getsize(f) > 0:  # a run still in progress has written nothing yet
        rows[(m.group(1), int(m.group(2)), int(m.group(3)))].append(json.load(open(f)))

def med(v):
    return statistics.median(v)

def rng(v):
    return f" ({min(v):.3g}-{max(v):.3g})" if len(v) > 1 else ""

for mode in ("ttft", "decode", "decode-approx"):
    ns = sorted({n for (m, n, _) in rows if m == mode})
    if not ns:
        continue
    if mode == "decode-approx":
        print("`--approx` (routed experts on int8 activations, VNNI; not exact):")
    if mode == "ttft":
        print("| prompt | 3 layers (KDA): TTFT s | floor | x floor | 4 layers (KDA x3 + MLA): TTFT s | floor | x floor | 4/3 |")
    else:
        print("| context | 3 layers: s/token | floor (disk / memory / compute) | x floor | 4 layers: s/token | floor (disk / memory / compute) | x floor | 4/3 |")
    print("|---|---|---|---|---|---|---|---|")
    for n in ns:
        cells, main = [], {}
        for layers in (3, 4):
            runs = rows.get((mode, n, layers), [])
            if not runs:
                cells += ["-"] * 3
                continue
            if mode == "ttft":
                t = [r["ttft_s"] for r in runs]
                fl = [r["ttft_floor_s"] for r in runs]
                cells += [f"{med(t):.1f}{rng(t)}", f"{med(fl):.1f}", f"{med(t) / med(fl):.2f}"]
            else:
                t = [r["s_per_token"] for r in runs]
                fl = [r["floor_s_per_token"] for r in runs]
                sides = "/".join(f"{med([r[k] for r in runs]):.3f}" for k in
                                 ("floor_disk_s_per_token", "floor_memory_s_per_token", "floor_compute_s_per_token"))
                cells += [f"{med(t):.3f}{rng(t)}", f"{med(fl):.3f} ({sides})", f"{med(t) / med(fl):.2f}"]
            main[layers] = med(t)
        ratio = f"{main[4] / main[3]:.2f}" if 3 in main and 4 in main else "-"
        print(f"| {n:,} | " + " | ".join(cells) + f" | {ratio} |")
    print()
# The roofs of the runs.
allr = [r for v in rows.values() for r in v]
if allr:
    mem = [r["memory_gbps"] for r in allr]
    pk = [r["peak_gflops"] for r in allr]
    raw = [r["raw_gbps"] for r in allr]
    print(f"roofs over {len(allr)} runs: memory {med(mem):.1f} GB/s{rng(mem)}, FMA {med(pk):.0f} GFLOP/s{rng(pk)}, "
          f"raw disk {med(raw):.2f} GB/s{rng(raw)}; commit {allr[0].get('git_commit')}, kernels {allr[0].get('kernel_path')}, "
          f"threads {allr[0].get('threads')}")
