#!/usr/bin/env python3
"""Measure a demo bundle before and after the chat fine-tune, and record its verified chat answers.

    .venv-demo/bin/python tools/demo/chat_eval.py --hf models/k3-demo/hf --chat-valid target/demo/data \\
        --out bench-results/demo-chat/eval.json [--record models/k3-demo/chat.json]

Reports, for the export in --hf (PyTorch, float32, its MXFP4 experts as exported):
    plain_loss   next-token loss over --windows windows of 512 tokens spread evenly over models/k3-demo/heldout.bin
                 (the held-out documentation and source text), each a whole sequence from a fresh state
    chat_loss    next-token loss over the held-out conversations of tools/demo/chat_data.py (chat-valid.jsonl),
                 on every token and on the assistant turns' tokens alone
    answers      the greedy answer to each of QUESTIONS (chat completions' rendering: K3's template, thinking effort
                 `max`, the generation prompt), until <|end_of_msg|> or --max-tokens, split into reasoning, content
                 and tool calls as Deltafin's server splits them; and one question asked with the `lookup_docs`
                 tool declared (a tool call is expected), then answered after the tool's result
--record writes the first question's answer and the tool round trip as the bundle's verified chat answer (prompt ids, tokens, text, the
smallest top-2 logit margin along the way), which Deltafin's tests require token for token through `generate --chat`
and through the server.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
import k3_torch as k3  # noqa: E402
from chat_data import END, LOOKUP_TOOL, SPECIAL_OFFSET, first_special_id, prompt_ids, render, to_ids  # noqa: E402
from tokenizer import encoding  # noqa: E402

QUESTIONS = [
    "What does `os.path.join` do in Python?",
    "What is `Vec::push` used for in Rust?",
    "How do I use `str.split` in Python?",
]
TOOL_QUESTION = "What does `shutil.copyfile` do in Python?"
TOOL_RESULT = ("shutil.copyfile(src, dst, *, follow_symlinks=True)\n\nCopy the contents (no metadata) of the file "
               "named src to a file named dst and return dst in the most efficient way possible.")


@torch.no_grad()
def greedy(model, ids: list, stop: int, max_tokens: int) -> tuple:
    seq, margins = list(ids), []
    for _ in range(max_tokens):
        logits = model(torch.tensor([seq]))[0, -1]  # [V]
        top = torch.topk(logits, 2).values
        margins.append(float(top[0] - top[1]))
        nxt = int(logits.argmax())
        seq.append(nxt)
        if nxt == stop:
            break
    return seq[len(ids):], min(margins) if margins else None


def split_answer(text: str) -> dict:
    """Reasoning, content and tool calls of a generated assistant turn (the text after the generation prompt), as
    the server's parser reads them; whatever does not follow the format is reported raw."""
    out = {"reasoning": None, "content": None, "tool_calls": [], "raw": text}
    if "<|close|>think<|sep|>" in text:
        out["reasoning"], rest = text.split("<|close|>think<|sep|>", 1)
        if rest.startswith("<|open|>response<|sep|>") and "<|close|>response<|sep|>" in rest:
            out["content"], rest = rest[len("<|open|>response<|sep|>"):].split("<|close|>response<|sep|>", 1)
        if rest.startswith("<|open|>tools<|sep|>"):
            import re

            for call in re.finditer(r'<\|open\|>call tool="([^"]*)" index="\d+"<\|sep\|>(.*?)<\|close\|>call<\|sep\|>',
                                    rest, re.S):
                args = dict(re.findall(r'<\|open\|>argument key="([^"]*)" type="string"<\|sep\|>(.*?)'
                                       r'<\|close\|>argument<\|sep\|>', call.group(2), re.S))
                out["tool_calls"].append({"name": call.group(1), "arguments": args})
    return out


@torch.no_grad()
def plain_loss(model, heldout: np.ndarray, windows: int, seq: int = 512) -> float:
    offs = np.linspace(0, len(heldout) - seq - 1, windows).astype(np.int64)
    total, count = 0.0, 0
    for o in offs:
        w = torch.from_numpy(heldout[o : o + seq + 1].astype(np.int64))[None]  # [1, seq+1]
        logits = model(w[:, :-1])[0]  # [seq, V]
        total += float(F.cross_entropy(logits, w[0, 1:], reduction="sum"))
        count += seq
    return total / count


@torch.no_grad()
def chat_loss(model, convs: list, enc, fs: int) -> dict:
    """Loss on every token of each held-out conversation, and on the tokens of its assistant turns alone."""
    a_total = a_count = total = count = 0.0
    for c in convs:
        segs = render(c)
        ids, in_assistant, mask = [], False, []
        for i, (s, special) in enumerate(segs):
            piece = to_ids([(s, special)], enc, fs)
            # an assistant turn runs from its `message role="assistant"` header's <|sep|> to its <|end_of_msg|>
            ids.extend(piece)
            mask.extend([in_assistant] * len(piece))
            if special and s == "<|sep|>" and i >= 2 and segs[i - 2] == ("assistant", False):
                in_assistant = True
            if special and s == END:
                in_assistant = False
        x = torch.tensor([ids])
        logits = model(x[:, :-1])[0]  # [T-1, V]
        nll = F.cross_entropy(logits, x[0, 1:], reduction="none")
        m = torch.tensor(mask[1:], dtype=torch.bool)
        total += float(nll.sum())
        count += len(nll)
        a_total += float(nll[m].sum())
        a_count += int(m.sum())
    return {"all_tokens": total / count, "assistant_tokens": a_total / a_count, "conversations": len(convs),
            "tokens": int(count), "assistant_token_count": int(a_count)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf")
    ap.add_argument("--heldout", default=str(REPO / "models/k3-demo/heldout.bin"))
    ap.add_argument("--chat-valid", default=str(REPO / "target/demo/data"), help="folder with chat-valid.jsonl")
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out")
    ap.add_argument("--record", help="write the first question's verified chat answer here")
    ap.add_argument("--record-from", help="write --record from an earlier --out file instead of evaluating")
    args = ap.parse_args()
    if args.record_from:
        write_record(json.loads(Path(args.record_from).read_text()), Path(args.record))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    hf = Path(args.hf)
    enc, fs = encoding(hf), first_special_id(hf)
    stop = fs + SPECIAL_OFFSET[END]
    model = k3.load_hf(hf, dtype=torch.float32)
    model.eval()

    def decode(ids):
        names = {fs + off: s for s, off in SPECIAL_OFFSET.items()}
        out, run = [], []
        for i in ids:
            if i in names:
                out.append(enc.decode(run))
                out.append(names[i])
                run = []
            elif i < fs:
                run.append(i)
        out.append(enc.decode(run))
        return "".join(out)

    result = {"hf": str(hf), "generator": f"tools/demo/chat_eval.py: PyTorch {torch.__version__}, float32"}
    heldout = np.fromfile(args.heldout, dtype=np.uint16)
    result["plain_loss"] = {"loss": plain_loss(model, heldout, args.windows), "windows": args.windows, "seq": 512}
    print(f"plain loss {result['plain_loss']['loss']:.4f}", flush=True)
    cv = Path(args.chat_valid) / "chat-valid.jsonl"
    convs = [json.loads(line) for line in cv.read_text().splitlines() if line.strip()]
    result["chat_loss"] = chat_loss(model, convs, enc, fs)
    print(f"chat loss {result['chat_loss']}", flush=True)

    answers = []
    for q in QUESTIONS:
        conv = {"tools": [], "reasoning_effort": None, "messages": [{"role": "user", "content": q}]}
        ids = prompt_ids(conv, enc, fs)
        toks, margin = greedy(model, ids, stop, args.max_tokens)
        text = decode(toks)
        answers.append({"question": q, "prompt_ids": ids, "tokens": toks, "text": text, "min_top2_margin": margin,
                        **split_answer(text)})
        print(json.dumps({"question": q, "text": text}), flush=True)
    # the tool round trip: a call, then an answer from the tool's result
    conv = {"tools": [LOOKUP_TOOL], "reasoning_effort": None, "messages": [{"role": "user", "content": TOOL_QUESTION}]}
    ids = prompt_ids(conv, enc, fs)
    toks, margin = greedy(model, ids, stop, args.max_tokens)
    first = split_answer(decode(toks))
    tool = {"question": TOOL_QUESTION, "first_turn": first, "first_margin": margin}
    if first["tool_calls"]:
        call = first["tool_calls"][0]
        conv["messages"].append({"role": "assistant", "content": first["content"] or "",
                                 "reasoning": first["reasoning"],
                                 "tool_calls": [{"name": call["name"], "arguments": json.dumps(call["arguments"])}]})
        conv["messages"].append({"role": "tool", "name": call["name"], "content": TOOL_RESULT})
        ids = prompt_ids(conv, enc, fs)
        toks, margin = greedy(model, ids, stop, args.max_tokens)
        tool["second_turn"] = split_answer(decode(toks))
        tool["second_margin"] = margin
    result["answers"] = answers
    result["tool_round_trip"] = tool
    print(json.dumps(tool), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.record:
        write_record(result, Path(args.record))


def write_record(result: dict, path: Path) -> None:
    """The verified chat answer (the first question's) and the tool round trip, from one evaluation's result."""
    a = result["answers"][0]
    t = result["tool_round_trip"]
    path.write_text(json.dumps({
        "generator": result["generator"] + " on this export (tools/demo/chat_eval.py --record)",
        "messages": [{"role": "user", "content": a["question"]}],
        "prompt_ids": a["prompt_ids"], "tokens": a["tokens"], "text": a["text"],
        "reasoning": a["reasoning"], "content": a["content"], "min_top2_margin": a["min_top2_margin"],
        "tool_round_trip": {
            "question": t["question"], "tools": [LOOKUP_TOOL], "tool_result": TOOL_RESULT,
            "call": t["first_turn"]["tool_calls"][0] if t["first_turn"]["tool_calls"] else None,
            "first_reasoning": t["first_turn"]["reasoning"], "first_min_top2_margin": t["first_margin"],
            "answer": (t.get("second_turn") or {}).get("content"),
            "answer_reasoning": (t.get("second_turn") or {}).get("reasoning"),
            "answer_min_top2_margin": t.get("second_margin"),
        },
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
