#!/usr/bin/env python3
"""How far Deltafin's int8 spine moves a trained model: top-1 agreement and KL against the bf16 spine over held-out
text, for each storage choice, and the approximate mode (int8 activations for the routed experts); with
--latent-cache, how far the MLA latent cache's bf16 rounding moves it (against an f32 spine with an f32 cache).

    python3 tools/demo/fidelity.py --bin target/release/deltafin --hf models/k3-demo/hf \\
        --tokens models/k3-demo/heldout.bin --n 4096 --out bench-results/demo-fidelity.json

Each configuration is a `deltafin convert` of the same checkpoint; `deltafin logits --all-positions` writes the
logits after every token of the held-out text, fed one at a time (teacher forcing), in windows of 512 tokens
spread evenly over it, each from a fresh state (the model was trained on sequences of 512). The reference is the bf16
spine, which equals the exported weights (the checkpoint is bf16) and reproduces PyTorch's greedy continuation
token for token (models/k3-demo/continuation.json). Per configuration: top-1 agreement with the reference, mean and
99th-percentile KL(reference || configuration) in nats per position, and the store's spine size.
Needs only numpy.
"""

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np

CONFIGS = [
    # name, convert flags, run flags
    ("bf16 (reference)", ["--spine", "bf16"], []),
    ("the default (--spine auto)", [], []),
    ("f32", ["--spine", "f32"], []),
    ("int8 per row", ["--spine", "int8"], []),
    ("int8 groups of 128", ["--spine", "int8", "--int8-group", "128"], []),
    ("int8 groups of 32", ["--spine", "int8", "--int8-group", "32"], []),
    ("int8 per row, router f32", ["--spine", "int8", "--router-f32"], []),
    ("int8 groups of 32, router f32", ["--spine", "int8", "--int8-group", "32", "--router-f32"], []),
    ("int8 per row, approximate mode", ["--spine", "int8"], ["--approx"]),
    ("int8 groups of 32, router f32, approximate mode", ["--spine", "int8", "--int8-group", "32", "--router-f32"],
     ["--approx"]),
]

# Where the int8 spine's disagreement comes from: the per-row int8 spine with one class of matrices
# kept in bf16 (`convert --keep NAME=DTYPE`), then the cumulative mixes that the classes suggest.
KEEP_CLASSES = [
    ("output head", ["lm_head"]),
    ("embeddings", ["embed_tokens"]),
    ("routers", ["block_sparse_moe.gate.weight"]),
    ("latent projections", ["routed_expert_"]),
    ("shared experts", ["shared_experts"]),
    ("dense MLP (layer 0)", ["mlp."]),
    ("KDA projections", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]),
    ("KDA gates", ["f_a_proj", "f_b_proj", "b_proj", "self_attn.g_proj"]),
    ("MLA projections", ["q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj"]),
]
# What the MLA latent cache's bf16 rounding does (`--latent-cache`): with an f32 spine the second row is the cache's
# effect alone; the bf16 and int8 spines are shown with either cache beside it.
LATENT_CACHE = [
    ("f32 spine, f32 latent cache (reference)", ["--spine", "f32"], ["--latent-cache", "f32"]),
    ("f32 spine, bf16 latent cache", ["--spine", "f32"], ["--latent-cache", "bf16"]),
    ("bf16 spine, f32 latent cache", ["--spine", "bf16"], ["--latent-cache", "f32"]),
    ("bf16 spine, bf16 latent cache (its default)", ["--spine", "bf16"], ["--latent-cache", "bf16"]),
    ("int8 per row, f32 latent cache", ["--spine", "int8"], ["--latent-cache", "f32"]),
    ("int8 per row, bf16 latent cache (its default)", ["--spine", "int8"], ["--latent-cache", "bf16"]),
]
ABLATION = [("bf16 (reference)", ["--spine", "bf16"], [])] + [
    (f"int8 per row, {name} bf16", ["--spine", "int8", *[a for p in pats for a in ("--keep", f"{p}=bf16")]], [])
    for name, pats in KEEP_CLASSES
]


def log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release/deltafin")
    ap.add_argument("--hf", default="models/k3-demo/hf")
    ap.add_argument("--tokens", default="models/k3-demo/heldout.bin", help="uint16 held-out token ids")
    ap.add_argument("--n", type=int, default=2048, help="positions in all")
    ap.add_argument("--window", type=int, default=512,
                    help="tokens per window, each from a fresh state (the model was trained on 512)")
    ap.add_argument("--out", help="JSON results")
    ap.add_argument("--torch-ref", metavar="NPY",
                    help="PyTorch's log-probabilities for the same positions (tools/demo/quant_study.py --save-ref): "
                         "each configuration is also compared with the training framework")
    ap.add_argument("--ablation", action="store_true",
                    help="keep one class of spine matrices in bf16 at a time instead of the storage schemes")
    ap.add_argument("--latent-cache", action="store_true",
                    help="the MLA latent cache in bf16 against f32, under each spine, instead of the storage schemes")
    ap.add_argument("--config", action="append", default=[], metavar="FLAGS",
                    help="convert flags as one string (repeatable): the reference and these instead of the built-in set")
    args = ap.parse_args()
    all_ids = np.fromfile(args.tokens, dtype=np.uint16).astype(int)
    n_win = max(1, args.n // args.window)
    starts = np.linspace(0, len(all_ids) - args.window, n_win).astype(int)
    windows = [all_ids[s:s + args.window].tolist() for s in starts]  # evenly spread over the held-out text
    rows, ref = [], None
    torch_ref = np.load(args.torch_ref).astype(np.float64) if args.torch_ref else None  # [positions, V]
    with tempfile.TemporaryDirectory() as tmp:
        configs = ABLATION if args.ablation else LATENT_CACHE if args.latent_cache else CONFIGS
        if args.config:  # the reference, then the configurations asked for
            configs = configs[:1] + [(f, f.split(), []) for f in args.config]
        for name, conv, run in configs:
            store = Path(tmp) / "store"
            subprocess.run(["rm", "-rf", str(store)], check=True)
            subprocess.run([args.bin, "convert", "--from", args.hf, "--to", str(store), *conv], check=True,
                           capture_output=True)
            out = Path(tmp) / "logits.bin"
            lps, nll = [], []
            for ids in windows:
                subprocess.run([args.bin, "logits", "--model", str(store), "--prompt-tokens", ",".join(map(str, ids)),
                                "--all-positions", str(out), *run], check=True, capture_output=True)
                w = log_softmax(np.fromfile(out, dtype="<f4").reshape(len(ids), -1).astype(np.float64))
                lps.append(w)
                nll.extend(-w[np.arange(len(ids) - 1), ids[1:]])
            manifest = json.loads((store / "manifest.json").read_text())
            lp = np.concatenate(lps)
            if ref is None:
                ref = lp
            kl = (np.exp(ref) * (ref - lp)).sum(-1)
            # How decisive the reference was where the top token flipped: the gap between its
            # two best log-probabilities (a small model has many near ties, which any rounding flips).
            top2 = np.sort(ref, -1)[:, -2:]
            gap = top2[:, 1] - top2[:, 0]
            flipped = lp.argmax(-1) != ref.argmax(-1)
            row = {
                "config": name, "convert": conv, "run": run,
                "top1_agreement": float((lp.argmax(-1) == ref.argmax(-1)).mean()),
                "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
                "flipped_gap_median": float(np.median(gap[flipped])) if flipped.any() else None,
                "top1_agreement_gap_ge_0.1": float(1 - flipped[gap >= 0.1].mean()),
                "share_gap_ge_0.1": float((gap >= 0.1).mean()),
                # The model's own quality on the text, as a sanity check: next-token loss.
                "nll": float(np.mean(nll)),
                "spine_bytes": manifest["spine"]["bytes"],
                "matrix_dtype": manifest["spine"]["matrix_dtype"],
            }
            if torch_ref is not None:
                if torch_ref.shape != lp.shape:
                    raise SystemExit(f"--torch-ref holds {torch_ref.shape}, these positions need {lp.shape}: make it with "
                                     f"quant_study.py --n {args.n} --window {args.window}")
                # Against the training framework (PyTorch, float32, whole sequences): the same statistics.
                tkl = (np.exp(torch_ref) * (torch_ref - lp)).sum(-1)
                row["vs_torch"] = {"top1_agreement": float((lp.argmax(-1) == torch_ref.argmax(-1)).mean()),
                                   "kl_mean": float(tkl.mean()), "kl_p99": float(np.percentile(tkl, 99))}
                print(f"{name:50} against PyTorch: top-1 {100 * row['vs_torch']['top1_agreement']:6.2f}%  "
                      f"KL mean {row['vs_torch']['kl_mean']:.2e}", flush=True)
            rows.append(row)
            print(f"{name:50} top-1 {100 * row['top1_agreement']:6.2f}%  KL mean {row['kl_mean']:.2e}  "
                  f"p99 {row['kl_p99']:.2e}  nll {row['nll']:.4f}  spine {row['spine_bytes'] / 1e6:.1f} MB  "
                  f"top-1 where the reference leads by >= 0.1 nats ({100 * row['share_gap_ge_0.1']:.0f}% of positions) "
                  f"{100 * row['top1_agreement_gap_ge_0.1']:.2f}%  median gap at flips "
                  f"{row['flipped_gap_median'] or 0:.3f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"positions": sum(map(len, windows)), "windows": [int(s) for s in starts],
                                              "window": args.window, "tokens_file": args.tokens, "hf": args.hf,
                                              "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
