"""How far approximate mode's integer prompt chunks move the trained demo model: top-1 agreement and KL against
exact mode, at the end of prompt chunks (where `--approx` runs a chunk's int8 spine products and routed experts in
integers on int8 activations), beside approximate mode fed one token at a time (routed experts' activations only).

    python3 tools/demo/chunk_fidelity.py --bin target/release/deltafin --hf models/k3-demo/hf \\
        --tokens models/k3-demo/heldout.bin --out bench-results/demo-chunk-fidelity.json

The store is `deltafin convert --spine int8` of the checkpoint (the integer products are for int8 spines). Windows
of 512 held-out tokens spread evenly over the text, each from a fresh state; in each, every prefix of a multiple of
`--step` tokens is sent as one prompt (`deltafin logits`, one chunk) and its last position's logits are compared.
The reference is exact mode, whose chunks equal one token at a time bit for bit. Needs only numpy.
"""

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release/deltafin")
    ap.add_argument("--hf", default="models/k3-demo/hf")
    ap.add_argument("--tokens", default="models/k3-demo/heldout.bin", help="uint16 held-out token ids")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--step", type=int, default=16, help="prefix lengths: multiples of this (16: the integer path's least)")
    ap.add_argument("--out")
    args = ap.parse_args()
    all_ids = np.fromfile(args.tokens, dtype=np.uint16).astype(int)
    starts = np.linspace(0, len(all_ids) - args.window, args.windows).astype(int)
    windows = [all_ids[s:s + args.window].tolist() for s in starts]
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        subprocess.run([args.bin, "convert", "--from", args.hf, "--to", str(store), "--spine", "int8"], check=True,
                       capture_output=True)

        def last_logits(ids, extra):
            r = subprocess.run([args.bin, "logits", "--model", str(store), "--prompt-tokens", ",".join(map(str, ids)),
                                *extra], check=True, capture_output=True, text=True)
            d = json.loads(r.stdout.strip().splitlines()[-1])
            return np.array(d["logits"], dtype=np.float64), d["numerics"]

        def stepwise(ids, extra):
            out = Path(tmp) / "all.bin"
            subprocess.run([args.bin, "logits", "--model", str(store), "--prompt-tokens", ",".join(map(str, ids)),
                            "--all-positions", str(out), *extra], check=True, capture_output=True)
            return np.fromfile(out, dtype="<f4").reshape(len(ids), -1).astype(np.float64)

        ref, chunk, step = [], [], []
        numerics = None
        for ids in windows:
            exact_all = stepwise(ids, [])
            approx_all = stepwise(ids, ["--approx"])
            for n in range(args.step, len(ids) + 1, args.step):
                a, numerics = last_logits(ids[:n], ["--approx"])
                ref.append(exact_all[n - 1])
                chunk.append(a)
                step.append(approx_all[n - 1])
    ref, chunk, step = (log_softmax(np.array(v)) for v in (ref, chunk, step))

    def compare(lp):
        kl = (np.exp(ref) * (ref - lp)).sum(-1)
        return {"top1_agreement": float((lp.argmax(-1) == ref.argmax(-1)).mean()), "kl_mean": float(kl.mean()),
                "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max())}

    result = {
        "positions": len(ref), "windows": args.windows, "window": args.window, "step": args.step,
        "store": "int8 spine per row", "approx_numerics": numerics,
        "approx_chunks_vs_exact": compare(chunk),
        "approx_one_token_at_a_time_vs_exact": compare(step),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
