#!/usr/bin/env python3
"""Why the int8 spine flips the demo model's top token: weight rounding alone, studied in PyTorch on a CPU.

    .venv-demo/bin/python tools/demo/quant_study.py --out bench-results/demo-quant-study.json \\
        [--train target/demo/tokenizer/train.bin]

The same 4,096 held-out positions as tools/demo/fidelity.py (8 windows of 512 evenly spread over
models/k3-demo/heldout.bin, each from a fresh state; here run as whole sequences, which equals one token at a time).
The reference is the checkpoint itself (its bf16 spine computed in float32). Each scheme rounds every spine matrix
(every 2-D tensor but the routed experts, which stay MXFP4 as exported) and reruns the model:

  bits N          symmetric round-to-nearest with one scale per row and N bits (N = 8 is Deltafin's per-row int8,
                  whose figures this reproduces; the sweep shows how the disagreement scales with the rounding step)
  int8 g32        one scale per 32 weights of a row (Deltafin's --int8-group 32)
  int8 gptq       GPTQ error feedback with per-row scales, calibrated on --train (the training split, 64 windows of
                  512 tokens; never the held-out text); only when --train is given

Each scheme runs twice: with free routing (each run picks its own experts, as inference does) and with pinned routing
(the reference's expert choice replayed, the weights recomputed from the scheme's own router scores). The gap between
the two is what flipped expert choices cost; the share of (token, MoE layer) pairs whose expert set changes is given
too. Needs torch and numpy (tools/demo/requirements.txt).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import k3_torch as k3  # noqa: E402


def windows(path: str, n: int, window: int) -> torch.Tensor:
    ids = np.fromfile(path, dtype=np.uint16).astype(np.int64)
    starts = np.linspace(0, len(ids) - window, max(1, n // window)).astype(int)  # as tools/demo/fidelity.py
    return torch.tensor(np.stack([ids[s:s + window] for s in starts]))  # [windows, window]


def round_rows(w: torch.Tensor, bits: int = 8, group: int = 0) -> torch.Tensor:
    """Symmetric round-to-nearest, one scale (max|w| / L, L = 2^(bits-1) - 1) per group of a row; group 0 = row."""
    rows, cols = w.shape
    g = group if group and cols % group == 0 else cols
    levels = 2 ** (bits - 1) - 1
    wg = w.reshape(rows, cols // g, g)  # [rows, groups, g]
    s = wg.abs().amax(-1, keepdim=True) / levels  # [rows, groups, 1]
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (torch.clamp(torch.round(wg / s), -levels, levels) * s).reshape(rows, cols)


def gptq_rows(w: torch.Tensor, h: torch.Tensor, block: int = 128, damp: float = 0.01) -> torch.Tensor:
    """GPTQ (Frantar et al. 2022): round columns in order, pushing each column's error onto the columns not yet
    rounded through the inverse of the input Hessian h = X^T X; int8, one scale per row (from the unrounded row)."""
    w = w.clone().double()  # [rows, cols]
    h = h.clone().double()  # [cols, cols]
    cols = w.shape[1]
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(cols, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)  # [cols, cols]
    s = w.abs().amax(-1) / 127  # [rows]
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.zeros_like(w)  # [rows, cols]
    for c0 in range(0, cols, block):
        c1 = min(c0 + block, cols)
        wb = w[:, c0:c1].clone()  # [rows, b]
        err = torch.zeros_like(wb)  # [rows, b]
        hb = hinv[c0:c1, c0:c1]  # [b, b]
        for j in range(c1 - c0):
            x = wb[:, j]  # [rows]
            qx = torch.clamp(torch.round(x / s), -127, 127) * s
            q[:, c0 + j] = qx
            e = (x - qx) / hb[j, j]
            wb[:, j:] -= e[:, None] * hb[j, j:][None, :]
            err[:, j] = e
        w[:, c1:] -= err @ hinv[c0:c1, c1:]
    return q.float()


class Study:
    def __init__(self, hf: str):
        self.model = k3.load_hf(hf, dtype=torch.float32).eval()
        self.orig = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        # Deltafin's spine matrices: every 2-D tensor but the routed experts (the schema's matrix role).
        self.spine = [n for n, p in self.model.named_parameters() if p.dim() == 2 and ".experts." not in n]
        self.mode, self.recorded, self.cursor, self.changed = "free", [], 0, []
        select = k3.select_experts

        def routed(logits, bias, top_k, n_group, topk_group, scaling, renormalize):
            idx, w = select(logits, bias, top_k, n_group, topk_group, scaling, renormalize)  # [N, k], [N, k]
            if self.mode == "record":
                self.recorded.append(idx.clone())
            elif self.mode == "pin":
                ref = self.recorded[self.cursor]  # [N, k] the reference's choice at this call
                self.cursor += 1
                self.changed.append((idx.sort(-1).values != ref.sort(-1).values).any(-1).double().mean().item())
                scores = torch.sigmoid(logits.float()).gather(-1, ref)  # [N, k]
                if renormalize and top_k > 1:
                    scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
                idx, w = ref, scores * scaling
            return idx, w

        k3.select_experts = routed  # LatentMoE.forward looks it up in the module at every call

    def set_weights(self, fn):
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(fn(n, self.orig[n]) if n in self.spine else self.orig[n])

    def run(self, x: torch.Tensor, mode: str = "free") -> torch.Tensor:
        self.mode, self.cursor, self.changed = mode, 0, []
        if mode == "record":
            self.recorded = []
        with torch.no_grad():
            lp = torch.cat([torch.log_softmax(self.model(x[i:i + 4]).double(), -1) for i in range(0, len(x), 4)])
        self.mode = "free"
        return lp  # [windows, window, V]

    def hessians(self, x: torch.Tensor) -> dict:
        """X^T X of each spine matrix's input over the calibration text (the routers' input is the MoE's)."""
        hs, hooks = {}, []

        def add(name):
            def hook(_mod, args):
                a = args[0].reshape(-1, args[0].shape[-1]).double()  # [tokens, in]
                hs[name] = hs.get(name, 0) + a.T @ a
            return hook

        for name, mod in self.model.named_modules():
            if isinstance(mod, torch.nn.Linear) and name + ".weight" in self.spine:
                hooks.append(mod.register_forward_pre_hook(add(name + ".weight")))
            if isinstance(mod, k3.LatentMoE):
                hooks.append(mod.register_forward_pre_hook(add(name + ".gate.weight")))
        self.run(x)
        for h in hooks:
            h.remove()
        return hs


def compare(ref: torch.Tensor, lp: torch.Tensor, x: torch.Tensor) -> dict:
    kl = (ref.exp() * (ref - lp)).sum(-1).flatten()  # [positions]
    return {
        "top1_agreement": (ref.argmax(-1) == lp.argmax(-1)).double().mean().item(),
        "kl_mean": kl.mean().item(),
        "kl_p99": float(np.percentile(kl.numpy(), 99)),
        "nll": -lp[:, :-1].gather(-1, x[:, 1:, None]).mean().item(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", default="models/k3-demo/hf")
    ap.add_argument("--tokens", default="models/k3-demo/heldout.bin")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--train", help="the training split's uint16 ids, for GPTQ's calibration (tools/demo/tokenizer.py)")
    ap.add_argument("--out")
    ap.add_argument("--save-ref", metavar="NPY",
                    help="write the reference's log-probabilities [positions, vocab] (float32) for fidelity.py --torch-ref")
    ap.add_argument("--no-schemes", action="store_true", help="only the reference (with --save-ref)")
    args = ap.parse_args()
    torch.manual_seed(0)
    x = windows(args.tokens, args.n, args.window)
    st = Study(args.hf)
    ref = st.run(x, "record")  # [windows, window, V]
    if args.save_ref:
        np.save(args.save_ref, ref.reshape(-1, ref.shape[-1]).float().numpy())
    if args.no_schemes:
        return
    schemes = [(f"bits {b}", lambda n, w, b=b: round_rows(w, b)) for b in (6, 7, 8, 9, 10, 11, 12)]
    schemes.append(("int8 g32", lambda n, w: round_rows(w, 8, 32)))
    if args.train:
        cal = windows(args.train, 64 * args.window, args.window)  # [64, window]
        st.set_weights(lambda n, w: w)
        hs = st.hessians(cal)
        schemes.append(("int8 gptq", lambda n, w: gptq_rows(w, hs[n]) if n in hs else round_rows(w)))
    rows = []
    for name, fn in schemes:
        t0 = time.time()
        st.set_weights(fn)
        free = compare(ref, st.run(x), x)
        pinned = compare(ref, st.run(x, "pin"), x)
        changed = float(np.mean(st.changed))
        rows.append({"scheme": name, "free": free, "pinned": pinned, "expert_set_changed": changed})
        print(f"{name:10} free: top-1 {100 * free['top1_agreement']:6.2f}%  KL {free['kl_mean']:.2e}   "
              f"pinned: top-1 {100 * pinned['top1_agreement']:6.2f}%  KL {pinned['kl_mean']:.2e}   "
              f"expert sets changed {100 * changed:.2f}%  nll {free['nll']:.4f}  ({time.time() - t0:.0f} s)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "positions": int(x.numel()), "window": args.window, "tokens_file": args.tokens, "hf": args.hf,
            "torch": torch.__version__, "calibration": args.train, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
