"""Markdown table of a `deltafin bench --streams ... --json` run (BENCHMARKS.md section 15).

python3 bench-results/streams-mla/summarize.py bench-results/streams-mla/k3-real4-streamed-ctx4000.json
"""

import json
import sys


def human(b: float) -> str:
    return f"{b / 1e9:.2f} GB" if b >= 1e9 else f"{b / 1e6:.0f} MB"


for path in sys.argv[1:]:
    d = json.load(open(path))
    print(f"{path}: streams {d['streams']}")
    print("| streams | agg tok/s | vs solo | s/token/seq [range] | read/token | vs solo | experts / spine per token"
          " | distinct experts / layer / step | step vs floor (disk/memory/compute s) | disk idle |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in d["configs"]:
        r = c["ranges"]["s_per_token"]
        vs = c["vs_solo"]
        print(
            f"| {c['streams']} | {c['aggregate_tokens_per_s']:.3f} | {vs['aggregate_vs_solo']:.2f}x"
            f" | {c['s_per_token_per_sequence']:.3f} [{r['min']:.3f}-{r['max']:.3f}]"
            f" | {human(c['bytes_read_per_generated_token'])} | {vs['bytes_per_generated_token_vs_solo']:.2f}x"
            f" | {human(c['expert_bytes_per_generated_token'])} / {human(c['spine_bytes_per_generated_token'])}"
            f" | {c['distinct_experts_per_layer_per_step']:.1f} / {c['experts_per_layer_per_step_if_unshared']:.0f}"
            f" | {c['step_vs_floor']:.2f} ({c['floor_disk_s_per_token']:.3f}/{c['floor_memory_s_per_token']:.3f}"
            f"/{c['floor_compute_s_per_token']:.3f})"
            f" | {100 * c['disk_idle_fraction']:.0f}% |"
        )
    c0 = d["configs"][0]
    print(f"context {c0['decode_context']}, kernel path {c0['kernel_path']}, commit {c0['git_commit']},"
          f" replay {min(c['replay_gbps'] for c in d['configs']):.2f}-{max(c['replay_gbps'] for c in d['configs']):.2f} GB/s,"
          f" memory roof {min(c['memory_gbps'] for c in d['configs']):.1f}-{max(c['memory_gbps'] for c in d['configs']):.1f} GB/s,"
          f" FMA roof {min(c['peak_gflops'] for c in d['configs']):.0f}-{max(c['peak_gflops'] for c in d['configs']):.0f} GFLOP/s")
    print()
