#!/usr/bin/env python3
"""Record router traces from the trained demo model on several kinds of held-out text, for `deltafin trace stats`
and the cache and prefetch studies.

    python3 tools/demo/traces.py --bin target/release/deltafin --hf models/k3-demo/hf \\
        --corpus target/demo/corpus --out models/k3-demo/traces

Each trace is `deltafin generate --trace` over a prompt of held-out text (the validation split of
tools/demo/corpus.py, never trained on) followed by greedy tokens, one JSON line per token with every MoE layer's
picks. The kinds:
    prose   a Python documentation page (reST)
    code    a Python standard-library module
    rust    a Rust standard-library source file
    mixed   documentation prose, then Python code, then Rust code, back to back
    chat    a long dialogue in plain text (User: / Assistant: turns built from held-out documentation paragraphs;
            the model was never trained on K3's chat format, so this is chat-shaped text, not a chat)
Prompts are cut to --prompt tokens (default 480, under the 512 the model was trained on), then --gen greedy tokens.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from tokenizer import encoding  # noqa: E402


def held_out(corpus: Path):
    by = {}
    with open(corpus / "docs.jsonl") as f:
        for line in f:
            d = json.loads(line)
            if d["split"] == "valid":
                by.setdefault(d["source"], []).append(d)
    return by


def longest(docs):
    return max(docs, key=lambda d: len(d["text"]))


def chat_text(docs) -> str:
    paras = [p.strip() for d in docs for p in d["text"].split("\n\n") if 80 < len(p.strip()) < 600]
    turns = []
    for i, p in enumerate(paras[:24]):
        first = p.split(".")[0][:120]
        turns.append(f"User: Can you explain this: {first}?\n\nAssistant: {p}\n")
    return "\n".join(turns)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release/deltafin")
    ap.add_argument("--hf", default="models/k3-demo/hf")
    ap.add_argument("--corpus", default="target/demo/corpus")
    ap.add_argument("--out", default="models/k3-demo/traces")
    ap.add_argument("--prompt", type=int, default=480)
    ap.add_argument("--gen", type=int, default=32)
    # The committed traces were recorded with the int8 spine, the conversion's default then; bf16 (the default now,
    # `--spine auto`) changes about one (token, layer) pair's expert set in thirteen (docs/numerics.md, "Spine quantisation").
    ap.add_argument("--spine", default="int8", help="the store's spine (convert --spine); int8 reproduces the committed traces")
    args = ap.parse_args()
    enc = encoding(Path(args.hf))
    by = held_out(Path(args.corpus))
    texts = {
        "prose": longest(by["python-docs"])["text"],
        "code": longest(by["python-code"])["text"],
        "rust": longest(by["rust-code"])["text"],
    }
    third = args.prompt // 3
    texts["mixed"] = "\n\n".join(enc.decode(enc.encode_ordinary(texts[k])[:third]) for k in ("prose", "code", "rust"))
    texts["chat"] = chat_text(by["python-docs"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        subprocess.run([args.bin, "convert", "--from", args.hf, "--to", str(store), "--spine", args.spine], check=True,
                       capture_output=True)
        for name, text in texts.items():
            ids = enc.encode_ordinary(text)[: args.prompt]
            trace = out / f"{name}.jsonl"
            subprocess.run([args.bin, "generate", "--model", str(store), "--prompt-tokens", ",".join(map(str, ids)),
                            "--max-tokens", str(args.gen), "--ignore-eos", "--trace", str(trace)], check=True,
                           capture_output=True)
            print(f"{name:6} {len(ids)} prompt tokens + {args.gen} generated -> {trace}")


if __name__ == "__main__":
    main()
