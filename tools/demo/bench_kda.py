#!/usr/bin/env python3
"""Time the chunked KDA form against the recurrent one on CPU (float32).

    .venv-demo/bin/python tools/demo/bench_kda.py                  # [2, 512], 4 heads of 32
    .venv-demo/bin/python tools/demo/bench_kda.py --T 1024 --H 8 --D 64 --backward --threads 1
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import k3_torch as k3  # noqa: E402
from check_parity import kda_inputs, rel  # noqa: E402


def timed(fn, reps):
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--D", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backward", action="store_true", help="also time forward + backward")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    q, k, v, log_g, beta = kda_inputs(args.B, args.T, args.H, args.D, lower_bound=-5.0)
    print(f"[B={args.B}, T={args.T}], {args.H} heads x {args.D}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, best of {args.reps}")
    o_r, _ = k3.kda_recurrent(q, k, v, log_g, beta)
    o_c, _ = k3.kda_chunk(q, k, v, log_g, beta)
    print(f"  chunk vs recurrent: rel {rel(o_c, o_r):.2e}")
    with torch.no_grad():
        t_r = timed(lambda: k3.kda_recurrent(q, k, v, log_g, beta), args.reps)
        t_c = timed(lambda: k3.kda_chunk(q, k, v, log_g, beta), args.reps)
    print(f"  forward   recurrent {t_r * 1e3:8.1f} ms   chunk {t_c * 1e3:8.1f} ms   speed-up {t_r / t_c:5.1f}x")
    if args.backward:
        ins = [t.clone().requires_grad_(True) for t in (q, k, v, log_g, beta)]

        def fb(fn):
            o, _ = fn(*ins)
            o.sum().backward()

        t_r = timed(lambda: fb(k3.kda_recurrent), args.reps)
        t_c = timed(lambda: fb(k3.kda_chunk), args.reps)
        print(f"  fwd + bwd recurrent {t_r * 1e3:8.1f} ms   chunk {t_c * 1e3:8.1f} ms   speed-up {t_r / t_c:5.1f}x")


if __name__ == "__main__":
    main()
