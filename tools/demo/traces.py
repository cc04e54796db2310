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
    chat    a conversation in K3's chat format, as a chat request renders it: the held-out questions and answers of
            tools/demo/chat_data.py (chat-valid.jsonl) as earlier turns, their reasoning included, then one more
            question and the generation prompt; the greedy tokens are the model's reasoning and answer
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


def chat_ids(chat_valid: Path, hf: Path, enc, budget: int) -> list:
    """A multi-turn conversation of held-out questions and answers, at most `budget` tokens with the last question
    and the generation prompt (tools/demo/chat_eval.py renders it as the server does)."""
    from chat_data import first_special_id, prompt_ids

    fs = first_special_id(hf)
    convs = [json.loads(line) for line in chat_valid.read_text().splitlines() if line.strip()]
    convs = [c for c in convs if not c["tools"]]
    messages, ids = [], None
    for i, c in enumerate(convs):
        turn = [m for m in c["messages"] if m["role"] != "system"]
        trial = {"tools": [], "reasoning_effort": None, "messages": messages + [turn[0]]}
        t = prompt_ids(trial, enc, fs)
        if len(t) > budget:
            break
        ids = t  # the conversation so far, asking this question
        messages += turn
    if ids is None:
        raise SystemExit(f"no held-out question fits {budget} tokens")
    return ids


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release/deltafin")
    ap.add_argument("--hf", default="models/k3-demo/hf")
    ap.add_argument("--corpus", default="target/demo/corpus")
    ap.add_argument("--out", default="models/k3-demo/traces")
    ap.add_argument("--prompt", type=int, default=480)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--chat-data", default="target/demo/data", help="folder with chat_data.py's chat-valid.jsonl")
    # The traces of the bundle before the chat fine-tune were recorded with the int8 spine, the conversion's default
    # then; these use the default now (`--spine auto`: bf16 for this model).
    ap.add_argument("--spine", default="auto", help="the store's spine (convert --spine)")
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
    prompts = {k: enc.encode_ordinary(t)[: args.prompt] for k, t in texts.items()}
    prompts["chat"] = chat_ids(Path(args.chat_data) / "chat-valid.jsonl", Path(args.hf), enc, args.prompt)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        subprocess.run([args.bin, "convert", "--from", args.hf, "--to", str(store), "--spine", args.spine], check=True,
                       capture_output=True)
        for name, ids in prompts.items():
            trace = out / f"{name}.jsonl"
            subprocess.run([args.bin, "generate", "--model", str(store), "--prompt-tokens", ",".join(map(str, ids)),
                            "--max-tokens", str(args.gen), "--ignore-eos", "--trace", str(trace)], check=True,
                           capture_output=True)
            print(f"{name:6} {len(ids)} prompt tokens + {args.gen} generated -> {trace}")


if __name__ == "__main__":
    main()
