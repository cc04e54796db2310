#!/usr/bin/env python3
"""Check an exported demo checkpoint against the reference: mlx-lm 0.32.2 loads it with its strict loader (every
parameter present, nothing left over) and its logits on a fixed text are compared with PyTorch's (k3_torch).

Two steps in two environments (PyTorch and mlx live in separate venvs):

    .venv-demo/bin/python tools/demo/check_mlx.py torch target/demo/hf /tmp/torch-logits.npz
    .venv/bin/python      tools/demo/check_mlx.py mlx   target/demo/hf /tmp/torch-logits.npz

The first writes the token ids of the text and PyTorch's float32 logits `[T, V]`; the second loads the checkpoint
with mlx-lm on the CPU in float32, runs the same ids, and prints max |mlx - torch| / max |mlx|, the argmax
agreement and the greedy continuation of both. It exits non-zero beyond 1e-4 relative or on any argmax mismatch.
"""

import sys
from pathlib import Path

import numpy as np

TEXT = (
    "The Rust programming language helps you write faster, more reliable software. "
    "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n"
)
GREEDY = 16


def ids_of(hf: Path):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tokenizer import encoding

    return [int(i) for i in encoding(hf).encode_ordinary(TEXT)]


def torch_side(hf: Path, out: Path):
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import k3_torch as k3

    bos = int(__import__("json").loads((hf / "config.json").read_text())["text_config"]["bos_token_id"])
    ids = [bos] + ids_of(hf)
    model = k3.load_hf(hf, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0].float().numpy()  # [T, V]
        seq = list(ids)
        for _ in range(GREEDY):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    np.savez(out, ids=np.array(ids), logits=logits, greedy=np.array(seq[len(ids):]))
    print(f"torch: {len(ids)} tokens, logits {logits.shape} -> {out}")


def mlx_side(hf: Path, ref: Path):
    import mlx.core as mx
    from mlx_lm.utils import load_model

    mx.set_default_device(mx.cpu)
    model, _ = load_model(hf, strict=True)  # strict: every parameter present, nothing left over
    model.set_dtype(mx.float32)
    r = np.load(ref)
    ids = [int(i) for i in r["ids"]]
    logits = np.array(model(mx.array([ids]))[0].astype(mx.float32))  # [T, V]
    rel = float(np.abs(logits - r["logits"]).max() / np.abs(logits).max())
    agree = float((logits.argmax(-1) == r["logits"].argmax(-1)).mean())
    seq = list(ids)
    for _ in range(GREEDY):
        seq.append(int(np.array(model(mx.array([seq]))[0, -1]).argmax()))
    greedy = seq[len(ids):]
    same = greedy == [int(g) for g in r["greedy"]]
    print(f"mlx-lm strict load ok; {len(ids)} tokens: max |mlx - torch| / max |mlx| = {rel:.2e}, "
          f"argmax agreement {100 * agree:.1f}%, greedy {GREEDY} tokens {'identical' if same else 'DIFFER'}")
    if rel > 1e-4 or agree < 1.0 or not same:
        sys.exit(1)


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("torch", "mlx"):
        sys.exit(__doc__)
    side, hf, f = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    torch_side(hf, f) if side == "torch" else mlx_side(hf, f)


if __name__ == "__main__":
    main()
