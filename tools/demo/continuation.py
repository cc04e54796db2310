#!/usr/bin/env python3
"""Record the demo model's verified continuation: a fixed prompt's greedy continuation computed by the training
framework (PyTorch, float32, the exported checkpoint with its MXFP4 experts), checked by Deltafin's tests through
`generate` and through the server.

    .venv-demo/bin/python tools/demo/continuation.py models/k3-demo/hf models/k3-demo/continuation.json

The prompt is tokenized with the `tiktoken` package on the bundle's rank file and K3's regex, without a BOS token
(as Deltafin's `generate --prompt` and a raw completion request do).
"""

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import k3_torch as k3  # noqa: E402
from tokenizer import encoding  # noqa: E402

PROMPT = "To read a file in Python,"
TOKENS = 24


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    hf, out = Path(sys.argv[1]), Path(sys.argv[2])
    enc = encoding(hf)
    ids = [int(i) for i in enc.encode_ordinary(PROMPT)]
    model = k3.load_hf(hf, dtype=torch.float32)
    model.eval()
    seq = list(ids)
    margins = []
    with torch.no_grad():
        for _ in range(TOKENS):
            logits = model(torch.tensor([seq]))[0, -1]  # [V]
            top = torch.topk(logits, 2).values
            margins.append(float(top[0] - top[1]))
            seq.append(int(logits.argmax()))
    tokens = seq[len(ids):]
    record = {
        "generator": f"tools/demo/continuation.py: PyTorch {torch.__version__}, float32, k3_torch on the export",
        "prompt": PROMPT,
        "prompt_ids": ids,
        "tokens": tokens,
        "text": enc.decode(tokens),
        # The smallest gap between the best and second-best logit along the way: how much numerical difference
        # the continuation tolerates before a token flips.
        "min_top2_margin": min(margins),
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
