"""Make a copy of a fixture checkpoint whose embedding and head are huge (vocab inflated), to
measure that `deltafin convert` streams: its peak RSS must not grow with tensor size.

usage: python3 tools/inflate_vocab.py fixtures/k3-tiny/hf /tmp/k3-wide 1048576
Only numpy is needed. The inflated model is for conversion measurements, not for parity.
"""
import json, shutil, struct, sys
from pathlib import Path

import numpy as np

src, dst, vocab = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
shutil.copytree(src, dst, dirs_exist_ok=True)
cfg = json.loads((dst / "config.json").read_text())
hidden = cfg["text_config"]["hidden_size"]
cfg["text_config"]["vocab_size"] = vocab
(dst / "config.json").write_text(json.dumps(cfg, indent=1))
index = json.loads((dst / "model.safetensors.index.json").read_text())
big = ["language_model.model.embed_tokens.weight", "language_model.lm_head.weight"]
shard = index["weight_map"][big[0]]
path = dst / shard
raw = path.read_bytes()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8 : 8 + n])
data = raw[8 + n :]
tensors = {}
for name, info in header.items():
    if name == "__metadata__":
        continue
    b, e = info["data_offsets"]
    tensors[name] = (info["dtype"], info["shape"], data[b:e])
rng = np.random.default_rng(0)
for name in big:
    f32 = rng.standard_normal((vocab, hidden), dtype=np.float32)
    bf16 = (f32.view(np.uint32) >> 16).astype(np.uint16)
    tensors[name] = ("BF16", [vocab, hidden], bf16.tobytes())
out_header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
for name in sorted(tensors):
    dt, shape, blob = tensors[name]
    out_header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(blob)]}
    blobs.append(blob)
    off += len(blob)
hb = json.dumps(out_header).encode()
hb += b" " * (-len(hb) % 8)
with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(hb)))
    f.write(hb)
    for blob in blobs:
        f.write(blob)
print(f"{dst}: vocab {vocab}, embed and head {vocab * hidden * 2 / 2**20:.0f} MiB each (bf16)")
