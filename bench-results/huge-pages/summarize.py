"""Medians [ranges] of the A/B runs in this folder: python3 summarize.py DIR"""
import glob
import json
import statistics as st
import sys

d = sys.argv[1] if len(sys.argv) > 1 else "."
keys = ["s_per_token", "achieved_gbps", "replay_gbps", "fio_random_records_gbps", "raw_gbps",
        "io_wait_fraction", "disk_idle_fraction", "ttft_s", "peak_rss_bytes"]
for spine in (2, 0):
    for which in ("before", "after"):
        runs = [json.load(open(f)) for f in sorted(glob.glob(f"{d}/{which}-spine{spine}-run*.json"))]
        if not runs:
            continue
        out = []
        for k in keys:
            v = [r[k] for r in runs if r.get(k) is not None]
            if v:
                out.append(f"{k} {st.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]")
        fix = {r["per_run"][0]["replay"].get("fixedbufs") for r in runs}
        ratio = [r["achieved_gbps"] / r["replay_gbps"] for r in runs if r.get("replay_gbps")]
        print(f"spine {'resident' if spine else 'streamed'} {which} ({len(runs)} runs, commit {runs[0].get('git_commit')}, fio fixedbufs {fix}):")
        print("   " + "; ".join(out))
        print("   achieved/replay per run: " + ", ".join(f"{x:.2f}" for x in ratio))
