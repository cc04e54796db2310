#!/usr/bin/env python3
"""Build the demo model's chat fine-tuning set: questions about Python and Rust names, each answered from the
documentation the model was trained on, rendered with Kimi K3's chat format and tokenized as Deltafin's server
tokenizes a chat request.

    python3 tools/demo/chat_data.py --corpus target/demo/corpus --hf models/k3-demo/hf --out target/demo/data \\
        --samples models/k3-demo/training/chat-samples.json

Sources (tools/demo/corpus.py's documents; the training split for training, the held-out split for validation):
    python-docs   every `.. function::`, `.. method::`, `.. class::`, `.. exception::` and `.. decorator::` entry of
                  the Python 3.11 reST sources with its first paragraph (reST roles turned into `code`)
    rust-code     every documented `pub fn`, `pub struct`, `pub enum`, `pub trait` and `macro_rules!` of Rust's core,
                  alloc and std sources: the first paragraph of its `///` comment and, when short, its first example
A conversation is: sometimes a system prompt, a user question about one name (several phrasings), an assistant turn
with a short thinking span that closes, then the answer (the signature and the documentation's own words). About
a quarter declare a `lookup_docs` tool; most of those answer in two turns: a call of the tool, the tool's result (the
documentation entry), and an answer drawn from it.

Rendering follows crates/text/src/chat/encode.rs (Moonshot's encoding_k3.py): the thinking-effort message (effort
`max` unless the conversation sets another), marker tokens as their special ids, and every other piece encoded on its
own with no special tokens. `--samples` writes a few rendered conversations with their token ids; a Rust test
(`crates/server/tests/chat_finetune_parity.rs`) renders the same messages with the server's encoder and requires
the same ids, so the fine-tune sees exactly what a chat request puts before the model.

Writes OUT/chat-train.bin and OUT/chat-valid.bin (uint16 ids, conversations back to back, no BOS: a chat prompt has
none), OUT/chat-train.idx.npy and OUT/chat-valid.idx.npy (the offset where each conversation starts, int64), and
OUT/chat-stats.json; with --plain also the plain-text OUT/train.bin and OUT/valid.bin (the corpus encoded with the
bundle's tokenizer, for the fine-tune's plain-text share and validation). Needs numpy and tiktoken.
"""

import argparse
import json
import random
import re
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from tokenizer import docs, encoding  # noqa: E402

OPEN, CLOSE, SEP, END = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
SPECIAL_OFFSET = {END: 2, OPEN: 3, CLOSE: 4, SEP: 5}  # from the first special id ([BOS]), as K3's

LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup_docs",
        "description": "Look up the reference documentation of a Python or Rust name.",
        "parameters": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "description": "The qualified name, e.g. os.path.join or Vec::push."},
                "language": {"type": "string", "enum": ["python", "rust"]},
            },
            "required": ["name", "language"],
        },
    },
}

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a helpful programming assistant.",
    "You are a concise assistant that answers questions about Python and Rust.",
    "Answer the user's programming questions.",
]

QUESTIONS = {
    "python": [
        "What does `{n}` do in Python?",
        "How do I use `{n}` in Python?",
        "Explain `{n}` in Python.",
        "What is `{n}` in Python?",
        "What is {n} for?",
        "Tell me about Python's `{n}`.",
        "what does {n} do",
    ],
    "rust": [
        "What does `{n}` do in Rust?",
        "How does `{n}` work in Rust?",
        "Explain `{n}` in Rust.",
        "What is `{n}` used for in Rust?",
        "Tell me about Rust's `{n}`.",
        "what does {n} do in rust",
    ],
}


# ---------------------------------------------------------------------------------------------------------------
# Documentation entries
# ---------------------------------------------------------------------------------------------------------------

RST_ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`")


def clean_rst(text: str) -> str:
    text = RST_ROLE.sub(lambda m: f"`{m.group(1).strip()}`", text)
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    text = re.sub(r"(?<![\w`])\*([^*\s][^*]*?)\*(?!\w)", r"\1", text)  # *emphasis*
    text = text.replace("\\ ", "").replace("\\", "")
    text = re.sub(r"`([^`]+)`_+", r"\1", text)  # `link`_
    return re.sub(r"\s+", " ", text).strip()


def python_entries(text: str):
    """(name, kind, signature, paragraph) for each documented callable or class of one reST page."""
    lines = text.split("\n")
    module = None
    classes = []  # (indent, name) of enclosing class directives
    directive = re.compile(r"^(\s*)\.\. (function|method|class|exception|decorator|module|currentmodule)::\s*(.+)$")
    i = 0
    while i < len(lines):
        m = directive.match(lines[i])
        i += 1
        if not m:
            continue
        indent, kind, arg = len(m.group(1)), m.group(2), m.group(3).strip()
        if kind in ("module", "currentmodule"):
            module = arg.split()[0] if arg and arg != "None" else None
            classes = []
            continue
        while classes and classes[-1][0] >= indent:
            classes.pop()
        sig = arg
        # continuation signatures (`.. function:: a(x)` then `              a(x, y)`) and options (`:noindex:`)
        while i < len(lines) and lines[i].strip() and (lines[i].strip().startswith(":") or
                                                         len(lines[i]) - len(lines[i].lstrip()) > indent + 3):
            i += 1
        while i < len(lines) and not lines[i].strip():
            i += 1
        para = []
        body_indent = indent + 3
        while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) >= body_indent:
            s = lines[i].strip()
            if s.startswith(".. ") or s.startswith(":"):
                break
            para.append(s)
            i += 1
        name = re.split(r"[\s(\[]", sig, maxsplit=1)[0]
        if kind == "class":
            classes.append((indent, name if "." in name or not module else name))
        if not para or not name or not re.match(r"^[A-Za-z_][\w.]*$", name):
            continue
        if kind == "method" and "." not in name and classes:
            owner = classes[-1][1].split(".")[-1]
            name = f"{owner}.{name}"
        elif kind in ("function", "class", "exception", "decorator") and "." not in name and module:
            if module not in ("builtins",) and not module.startswith("_"):
                name = f"{module}.{name}"
        base = re.split(r"[\s(\[]", sig, maxsplit=1)[0]
        shown = name + sig[len(base):] if name.endswith(base) else sig  # openpty() -> pty.openpty()
        shown = shown if kind != "decorator" else f"@{shown}"
        yield name, kind, shown, clean_rst(" ".join(para))


RUST_ITEM = re.compile(
    r"^(\s*)(?:pub(?:\([^)]*\))? )?(?:const )?(?:unsafe )?(?:extern \"[^\"]*\" )?(fn|struct|enum|trait) ([A-Za-z_]\w*)"
)
RUST_MACRO = re.compile(r"^(\s*)macro_rules! ([A-Za-z_]\w*)")
RUST_IMPL = re.compile(r"^(\s*)impl(?:<.*?>)?\s+(?:[\w:<>, ?&']+\s+for\s+)?([A-Z]\w*)")


def clean_rustdoc(text: str) -> str:
    text = re.sub(r"\[(`[^`\]]+`)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"\[(`[^`\]]+`)\](?:\[[^\]]*\])?", r"\1", text)
    text = re.sub(r"\[([^\]]+)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"\[([^\]]+)\]\[[^\]]*\]", r"\1", text)
    return re.sub(r"\s+", " ", text).strip()


def rust_module(path: str) -> str:
    """/usr/share/doc/rust-doc/html/src/alloc/vec/mod.rs.html -> std::vec (core and alloc are re-exported by std)."""
    m = re.search(r"/src/([a-z_]+)/(.*)\.rs\.html$", path)
    if not m:
        return ""
    crate, rest = m.group(1), [p for p in m.group(2).split("/") if p not in ("mod", "lib")]
    crate = "std" if crate in ("core", "alloc", "std") else crate
    return "::".join([crate] + rest)


def rust_entries(text: str, path: str):
    """(name, kind, signature, paragraph, example) for each documented public item of one source file."""
    lines = text.split("\n")
    module = rust_module(path)
    impl = None  # (indent, type)
    doc = []
    for line in lines:
        s = line.strip()
        mi = RUST_IMPL.match(line)
        if mi and not s.startswith("//"):
            impl = (len(mi.group(1)), mi.group(2))
            doc = []
            continue
        if s.startswith("///"):
            doc.append(s[3:][1:] if s[3:].startswith(" ") else s[3:])
            continue
        if s.startswith("#[") or s.startswith("#!["):
            continue
        if doc:
            m = RUST_ITEM.match(line) or RUST_MACRO.match(line)
            if m and (s.startswith("pub") or s.startswith("macro_rules!")):
                indent = len(m.group(1))
                if m.re is RUST_MACRO:
                    kind, item = "macro", m.group(2)
                else:
                    kind, item = m.group(2), m.group(3)
                if impl and indent > impl[0] and kind == "fn":
                    name = f"{impl[1]}::{item}"
                elif kind == "macro":
                    name = f"{item}!"
                elif kind == "fn" and module:
                    name = f"{module}::{item}"  # a free function: std::mem::swap
                else:
                    name = item  # a type or trait: Vec, Iterator
                sig = s.rstrip("{").rstrip().rstrip(";")
                if kind == "macro":
                    sig = f"{item}!"
                para, example = first_paragraph_and_example(doc)
                if para:
                    yield name, kind, sig, para, example
            doc = []


def first_paragraph_and_example(doc: list):
    para = []
    for d in doc:
        if not d.strip():
            if para:
                break
            continue
        if d.startswith("#") or d.startswith("```"):
            break
        para.append(d.strip())
    example = None
    try:
        start = next(i for i, d in enumerate(doc) if d.strip() == "# Examples")
        fence = next(i for i in range(start + 1, len(doc)) if doc[i].strip().startswith("```"))
        end = next(i for i in range(fence + 1, len(doc)) if doc[i].strip().startswith("```"))
        body = [d for d in doc[fence + 1 : end] if not d.strip().startswith("# ") and d.strip() != "#"]
        if 1 <= len(body) <= 8 and doc[fence].strip() in ("```", "```rust") and all(len(b) < 90 for b in body):
            example = "\n".join(body)
    except StopIteration:
        pass
    return clean_rustdoc(" ".join(para)), example


def shorten(text: str, limit: int = 420) -> str:
    """The first sentences of a paragraph, at most about `limit` characters, ending on a sentence."""
    if len(text) <= limit:
        return text
    cut = [m.end() for m in re.finditer(r"[.!?](?=\s+[A-Z`])", text) if m.end() <= limit]
    return text[: cut[-1]] if cut else ""


def entries(corpus: Path, split: str):
    seen = set()
    for d in docs(corpus, split):
        if d["source"] == "python-docs":
            for name, kind, sig, para in python_entries(d["text"]):
                if "c-api" in d["path"] or "extending" in d["path"]:
                    continue
                yield "python", name, kind, sig, para, None, seen
        elif d["source"] == "rust-code":
            # Skip the thousands of SIMD intrinsics (stdarch) and the integer macros' bodies (generic over `Self`)
            if "stdarch" in d["path"] or d["path"].endswith("_macros.rs.html"):
                continue
            for name, kind, sig, para, example in rust_entries(d["text"], d["path"]):
                yield "rust", name, kind, sig, para, example, seen


# ---------------------------------------------------------------------------------------------------------------
# Conversations
# ---------------------------------------------------------------------------------------------------------------

KIND_WORDS = {
    "function": "a function", "method": "a method", "class": "a class", "exception": "an exception",
    "decorator": "a decorator", "fn": "a function", "struct": "a struct", "enum": "an enum", "trait": "a trait",
    "macro": "a macro",
}


def owner_phrase(lang: str, name: str, kind: str) -> str:
    sep = "." if lang == "python" else "::"
    parts = name.rstrip("!").split(sep)
    what = KIND_WORDS[kind]
    if len(parts) > 1:
        owner = sep.join(parts[:-1])
        if lang == "rust" and kind == "fn" and owner[:1].isupper():
            return f"It is an associated function of `{owner}`."
        if kind == "method":
            return f"It is {what} of `{owner}`."
        return f"It is {what} in `{owner}`."
    return f"It is {what}."


def answer_text(lang: str, name: str, sig: str, para: str, example) -> str:
    text = f"`{sig}`\n\n{para}"
    if example:
        text += f"\n\nFor example:\n\n```rust\n{example}\n```"
    return text


def conversation(rng: random.Random, lang: str, name: str, kind: str, sig: str, para: str, example) -> dict:
    q = rng.choice(QUESTIONS[lang]).format(n=name)
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    messages.append({"role": "user", "content": q})
    language = "Python" if lang == "python" else "Rust"
    tools = []
    answer = answer_text(lang, name, sig, para, example)
    if rng.random() < 0.25:
        tools = [LOOKUP_TOOL]
    if tools and rng.random() < 0.8:
        messages.append({
            "role": "assistant", "content": "",
            "reasoning": f"The user asks about `{name}` in {language}. I will look up its documentation.",
            "tool_calls": [{"name": "lookup_docs", "arguments": json.dumps({"name": name, "language": lang})}],
        })
        messages.append({"role": "tool", "name": "lookup_docs", "content": f"{sig}\n\n{para}"})
        messages.append({
            "role": "assistant", "content": answer,
            "reasoning": f"The documentation describes `{name}`. I will answer from it.",
        })
    else:
        messages.append({
            "role": "assistant", "content": answer,
            "reasoning": f"The user asks about `{name}` in {language}. {owner_phrase(lang, name, kind)} "
                         "I will explain what it does.",
        })
    effort = "max" if rng.random() < 0.85 else rng.choice(["low", "high"])
    return {"tools": tools, "reasoning_effort": effort, "messages": messages}


# ---------------------------------------------------------------------------------------------------------------
# Rendering (crates/text/src/chat/encode.rs)
# ---------------------------------------------------------------------------------------------------------------


def py_json(v, compact=True, sort=True) -> str:
    return json.dumps(v, ensure_ascii=False, separators=(",", ":") if compact else (", ", ": "), sort_keys=sort)


def render(conv: dict) -> list:
    """-> [(text, special)] as the server's encoder writes it, generation prompt excluded (the assistant turns are
    part of the conversation)."""
    segs = []

    def special(s):
        segs.append((s, True))

    def text(s):
        if s:
            segs.append((s, False))

    def open_(tag, attrs=()):
        special(OPEN)
        text(tag)
        for k, v in attrs:
            text(f" {k}")
            text('="')
            text(v.replace("&", "&amp;").replace('"', "&quot;"))
            text('"')
        special(SEP)

    def close(tag):
        special(CLOSE)
        text(tag)
        special(SEP)

    def end_message():
        close("message")
        special(END)

    def system_typed(ty, body):
        open_("message", [("role", "system"), ("type", ty)])
        text(body.strip())
        end_message()

    if conv["tools"]:
        system_typed("tool-declare", "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
                     + py_json(conv["tools"]) + "\n```")
    effort = conv.get("reasoning_effort") or "max"
    system_typed("thinking-effort",
                 "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
                 "channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked "
                 f"with `thinking_effort={effort}`.")
    tool_index = 0
    for m in conv["messages"]:
        role = m["role"]
        if role in ("system", "user"):
            open_("message", [("role", role)])
            text(m["content"])
            end_message()
        elif role == "assistant":
            open_("message", [("role", "assistant")])
            open_("think")
            if (m.get("reasoning") or "").strip():
                text(m["reasoning"])
            close("think")
            open_("response")
            text(m["content"])
            close("response")
            calls = m.get("tool_calls") or []
            if calls:
                open_("tools")
                for i, c in enumerate(calls):
                    open_("call", [("tool", c["name"]), ("index", str(i + 1))])
                    for k, v in json.loads(c["arguments"]).items():
                        assert isinstance(v, str), "string arguments only"
                        open_("argument", [("key", k), ("type", "string")])
                        text(v)
                        close("argument")
                    close("call")
                close("tools")
            end_message()
            tool_index = 0
        elif role == "tool":
            tool_index += 1
            open_("message", [("role", "tool"), ("tool", m["name"]), ("index", str(tool_index))])
            text(m["content"])
            end_message()
    return segs


def to_ids(segs: list, enc, first_special: int) -> list:
    ids = []
    for s, special in segs:
        if special:
            ids.append(first_special + SPECIAL_OFFSET[s])
        else:
            ids.extend(enc.encode_ordinary(s))
    return ids


def first_special_id(hf: Path) -> int:
    """The id of [BOS], the first of the 256 special slots (K3's markers sit at fixed offsets from it)."""
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    return next(int(k) for k, v in cfg["added_tokens_decoder"].items() if v["content"] == "[BOS]")


def prompt_ids(conv: dict, enc, fs: int) -> list:
    """The conversation plus the generation prompt `<|open|>message role="assistant"<|sep|><|open|>think<|sep|>`."""
    segs = render(conv)
    segs += [("<|open|>", True), ("message", False), (" role", False), ('="', False), ("assistant", False),
             ('"', False), ("<|sep|>", True), ("<|open|>", True), ("think", False), ("<|sep|>", True)]
    return to_ids(segs, enc, fs)


# ---------------------------------------------------------------------------------------------------------------


def build(corpus: Path, split: str, enc, first_special: int, rng: random.Random):
    convs, ids, starts = [], [], []
    seen = set()
    counts = {"python": 0, "rust": 0, "tool_calls": 0, "with_example": 0}
    for lang, name, kind, sig, para, example, _ in entries(corpus, split):
        para = shorten(para)
        if len(para) < 40 or name in seen or len(sig) > 160:
            continue
        if any(w in para for w in ("FIXME", "TODO", "unstable", "Deprecated", "deprecated")):
            continue
        seen.add(name)
        conv = conversation(rng, lang, name, kind, sig, para, example)
        toks = to_ids(render(conv), enc, first_special)
        if len(toks) > 1024:
            continue
        starts.append(len(ids))
        ids.extend(toks)
        convs.append(conv)
        counts[lang] += 1
        counts["tool_calls"] += any(m.get("tool_calls") for m in conv["messages"])
        counts["with_example"] += example is not None
    # shuffle the conversation order (the windows start at conversation starts; neighbours fill the rest)
    order = list(range(len(convs)))
    rng.shuffle(order)
    out_ids, out_starts = [], []
    for k in order:
        a = starts[k]
        b = starts[k + 1] if k + 1 < len(starts) else len(ids)
        out_starts.append(len(out_ids))
        out_ids.extend(ids[a:b])
    return [convs[k] for k in order], np.asarray(out_ids, dtype=np.uint16), np.asarray(out_starts, dtype=np.int64), counts


def openai_messages(messages: list) -> list:
    """The conversation as a chat completions request carries it (reasoning_content, tool_calls with ids,
    tool results by tool_call_id)."""
    out, n = [], 0
    for m in messages:
        if m["role"] == "assistant":
            r = {"role": "assistant", "content": m["content"], "reasoning_content": m.get("reasoning")}
            if m.get("tool_calls"):
                r["tool_calls"] = []
                for c in m["tool_calls"]:
                    n += 1
                    r["tool_calls"].append({"id": f"call_{n}", "type": "function",
                                            "function": {"name": c["name"], "arguments": c["arguments"]}})
            out.append(r)
        elif m["role"] == "tool":
            out.append({"role": "tool", "tool_call_id": f"call_{n}", "content": m["content"]})
        else:
            out.append(dict(m))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="target/demo/corpus")
    ap.add_argument("--hf", default="models/k3-demo/hf", help="the bundle whose tokenizer renders the set")
    ap.add_argument("--out", default="target/demo/data")
    ap.add_argument("--samples", help="write a few rendered conversations with their ids (the Rust parity test's)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--plain", action="store_true", help="also write the plain-text train.bin and valid.bin")
    args = ap.parse_args()
    hf, out = Path(args.hf), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    enc = encoding(hf)
    first_special = first_special_id(hf)
    stats = {"first_special": first_special}
    samples = []
    for split in ("train", "valid"):
        rng = random.Random(f"{args.seed}-{split}")
        convs, ids, starts, counts = build(Path(args.corpus), split, enc, first_special, rng)
        ids.tofile(out / f"chat-{split}.bin")
        np.save(out / f"chat-{split}.idx.npy", starts)
        stats[split] = dict(conversations=len(convs), tokens=int(len(ids)), **counts)
        print(f"{split}: {len(convs)} conversations, {len(ids):,} tokens, {counts}", flush=True)
        if split == "valid":
            (out / "chat-valid.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
        if args.samples and split == "train":
            picked = [c for c in convs if c["tools"] and len(c["messages"]) > 3][:3]
            picked += [c for c in convs if not c["tools"]][:5]
            for c in picked:
                samples.append({"tools": c["tools"], "reasoning_effort": c["reasoning_effort"],
                                "messages": openai_messages(c["messages"]), "ids": to_ids(render(c), enc, first_special)})
    if args.plain:
        # The plain-text splits, encoded with the bundle's own rank file (as tools/demo/tokenizer.py encodes them
        # after training the ranks): the fine-tune mixes them in so that the continuation style survives.
        for split in ("train", "valid"):
            ids = []
            for d in docs(Path(args.corpus), split):
                ids.append(first_special)
                ids.extend(enc.encode_ordinary(d["text"]))
            np.asarray(ids, dtype=np.uint16).tofile(out / f"{split}.bin")
            stats[f"plain_{split}_tokens"] = len(ids)
            print(f"plain {split}: {len(ids):,} tokens", flush=True)
    (out / "chat-stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    if args.samples:
        Path(args.samples).write_text(json.dumps({
            "generator": "tools/demo/chat_data.py --samples", "tokenizer": str(hf),
            "conversations": samples}, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
