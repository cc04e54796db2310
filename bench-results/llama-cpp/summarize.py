#!/usr/bin/env python3
"""Tables of bench-results/llama-cpp/*.json (made by run.sh): Deltafin beside llama.cpp on one model, medians
over runs, ranges, Deltafin's floors from the same run, and the speed ratios."""
import glob, json, os, re, statistics, sys
from collections import defaultdict

here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
runs = defaultdict(list)
for f in sorted(glob.glob(os.path.join(here, "*.json"))):
    m = re.match(r"(llama|deltafin|deltafin-approx)-(prompt|decode)-(\d+)-run\d+\.json", os.path.basename(f))
    if not m or os.path.getsize(f) == 0:
        continue
    d = json.load(open(f))
    if m.group(1) == "llama":
        (t,) = [x for x in d if x["n_prompt"] > 0 or x["n_gen"] > 0]
        tok = t["n_prompt"] if t["n_prompt"] else t["n_gen"]
        # llama-bench reports tokens/s; as seconds for the prompt and s/token for decode
        val = t["avg_ns"] / 1e9 if m.group(2) == "prompt" else t["avg_ns"] / 1e9 / tok
        runs[(m.group(1), m.group(2), int(m.group(3)))].append({"value": val, "floor": None, "raw": t})
    else:
        key = "ttft_s" if m.group(2) == "prompt" else "s_per_token"
        fkey = "ttft_floor_s" if m.group(2) == "prompt" else "floor_s_per_token"
        runs[(m.group(1), m.group(2), int(m.group(3)))].append({"value": d[key], "floor": d[fkey], "raw": d})


def med(v):
    return statistics.median(v)


def rng(v):
    return f" ({min(v):.3g}-{max(v):.3g})" if len(v) > 1 else ""


for mode, unit in (("prompt", "time to first token, s"), ("decode", "decode, s/token")):
    ns = sorted({n for (_, m, n) in runs if m == mode})
    for n in ns:
        print(f"{mode} {n:,} tokens ({unit}; median (range) over runs):")
        base = runs.get(("llama", mode, n))
        for eng in ("llama", "deltafin", "deltafin-approx"):
            rs = runs.get((eng, mode, n))
            if not rs:
                continue
            v = [r["value"] for r in rs]
            line = f"  {eng:16s} {med(v):9.3f}{rng(v)}  n={len(v)}"
            fl = [r["floor"] for r in rs if r["floor"] is not None]
            if fl:
                line += f"  floor {med(fl):.3f}, x floor {med(v) / med(fl):.2f}"
            if base and eng != "llama":
                line += f"  llama.cpp / this = {med([r['value'] for r in base]) / med(v):.2f}x"
            print(line)
dl = [r["raw"] for (e, _, _), rs in runs.items() if e.startswith("deltafin") for r in rs]
if dl:
    mem = [r["memory_gbps"] for r in dl]
    pk = [r["peak_gflops"] for r in dl]
    print(f"Deltafin roofs over {len(dl)} runs: memory {med(mem):.1f} GB/s{rng(mem)}, FMA {med(pk):.0f} GFLOP/s{rng(pk)}; "
          f"commit {dl[0].get('git_commit')}, kernels {dl[0].get('kernel_path')}, threads {dl[0].get('threads')}")
ll = [r["raw"] for (e, _, _), rs in runs.items() if e == "llama" for r in rs]
if ll:
    print(f"llama.cpp build {ll[0].get('build_commit')} ({ll[0].get('build_number')}), {ll[0].get('cpu_info')}, "
          f"threads {ll[0].get('n_threads')}, type {ll[0].get('model_type')}, n_batch {ll[0].get('n_batch')}, "
          f"n_ubatch {ll[0].get('n_ubatch')}, flash_attn {ll[0].get('flash_attn')}")
