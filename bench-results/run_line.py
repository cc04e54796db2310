"""One line per `deltafin bench --json` run for the benchmark scripts: the time to first token
and the decode rate, each beside its floor from the same run. Usage: python3 run_line.py RUN.json"""
import json
import sys

path = sys.argv[1]
d = json.load(open(path))
prompt = (f"ttft {d['ttft_s']:.2f} s (floor {d['ttft_floor_s']:.2f}, x{d['ttft_s'] / d['ttft_floor_s']:.2f}; "
          f"{d['prefill_flops'] / 1e12:.2f} TFLOP; attention {d['prefill_attention_s']:.1f} s, "
          f"feed-forward {d['prefill_ffn_s']:.1f} s)")
decode = (f"decode {d['s_per_token']:.3f} s/token at context {d['decode_context']} (floor {d['floor_s_per_token']:.3f}: "
          f"disk {d['floor_disk_s_per_token']:.3f} mem {d['floor_memory_s_per_token']:.3f} "
          f"compute {d['floor_compute_s_per_token']:.3f}, x{d['s_per_token'] / d['floor_s_per_token']:.2f})")
print(f"{path}: {prompt}, {decode}; {d['memory_gbps']:.1f} GB/s, {d['peak_gflops']:.0f} GFLOP/s, "
      f"commit {d['git_commit']}", flush=True)
