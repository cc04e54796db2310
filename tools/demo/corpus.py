#!/usr/bin/env python3
"""Collect the demo model's training corpus from Debian packages: permissively licensed English and code.

    apt-get install python3.11-doc rust-doc libpython3.11-stdlib   # what the sources below come from
    python3 tools/demo/corpus.py --out target/demo/corpus           # writes docs.jsonl and sources.json

Sources (all read from the installed packages, nothing fetched; licences as their packages state them):
    python-docs   /usr/share/doc/python3.11/html/_sources/**.rst.txt   Python 3.11 documentation (reST sources),
                                                                       PSF License Version 2
    python-code   /usr/lib/python3.11/**.py (without the test suites)  Python 3.11 standard library, PSF License
    rust-books    /usr/share/doc/rust-doc/html/{book,reference,rust-by-example,nomicon,edition-guide,
                  embedded-book}/print.html                            The Rust books, MIT OR Apache-2.0
    rust-code     /usr/share/doc/rust-doc/html/src/**.rs.html          Rust 1.63 core, alloc, std, proc_macro and
                                                                       test sources, MIT OR Apache-2.0

One JSON object a line in docs.jsonl: {"source", "path", "split", "text"}. A document is held out for validation
when the first byte of sha1(path) is below 5 (about 2%), so the split does not depend on the order of files.
Everything is sorted, so a re-run on the same packages writes the same bytes.
"""

import argparse
import gzip
import hashlib
import html
import html.parser
import json
import sys
from pathlib import Path

PY_DOCS = Path("/usr/share/doc/python3.11/html/_sources")
PY_CODE = Path("/usr/lib/python3.11")
RUST_HTML = Path("/usr/share/doc/rust-doc/html")
RUST_BOOKS = ["book", "reference", "rust-by-example", "nomicon", "edition-guide", "embedded-book"]
# Python's own test suites are mostly generated data and fixtures: not the prose or code we want to model.
PY_SKIP = {"test", "tests", "idle_test", "lib2to3", "site-packages", "dist-packages", "__pycache__"}
HOLD_OUT_BELOW = 5  # of 256: ~2% of documents for validation


def read_maybe_gz(p: Path) -> str:
    data = p.read_bytes()
    if p.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


class _Text(html.parser.HTMLParser):
    """HTML to plain text: block elements become line breaks, <pre> keeps its lines, scripts and navigation go."""

    BLOCK = {"p", "div", "br", "li", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "table", "ul", "ol", "section",
             "blockquote", "dt", "dd"}
    SKIP = {"script", "style", "nav", "head", "button", "noscript"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out, self.skip, self.pre = [], 0, 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skip += 1
        elif tag == "pre":
            self.pre += 1
            self.out.append("\n")
        elif tag in self.BLOCK:
            self.out.append("\n")

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.skip = max(0, self.skip - 1)
        elif tag == "pre":
            self.pre = max(0, self.pre - 1)
            self.out.append("\n")
        elif tag in self.BLOCK:
            self.out.append("\n")

    def handle_data(self, data):
        if self.skip:
            return
        self.out.append(data if self.pre else " ".join(data.split(" ")))

    def text(self):
        lines = "".join(self.out).split("\n")
        # Collapse runs of blank lines; strip trailing spaces.
        res, blank = [], 0
        for line in lines:
            line = line.rstrip()
            blank = blank + 1 if not line else 0
            if blank <= 1:
                res.append(line)
        return "\n".join(res).strip() + "\n"


def html_text(src: str) -> str:
    p = _Text()
    p.feed(src)
    return p.text()


class _Code(html.parser.HTMLParser):
    """rustdoc's source pages: the text inside <pre class="rust"> (the line numbers are a separate <pre>)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out, self.depth = [], 0

    def handle_starttag(self, tag, attrs):
        if tag == "pre" and ("class", "rust") in attrs:
            self.depth = 1
        elif self.depth and tag == "pre":
            self.depth += 1

    def handle_endtag(self, tag):
        if self.depth and tag == "pre":
            self.depth -= 1

    def handle_data(self, data):
        if self.depth:
            self.out.append(data)


def rust_source(src: str) -> str:
    p = _Code()
    p.feed(src)
    return html.unescape("".join(p.out)).strip() + "\n"


def documents():
    for p in sorted(PY_DOCS.rglob("*.rst.txt")):
        yield "python-docs", p, read_maybe_gz(p)
    for p in sorted(PY_CODE.rglob("*.py")):
        if PY_SKIP.isdisjoint(p.relative_to(PY_CODE).parts):
            yield "python-code", p, read_maybe_gz(p)
    for book in RUST_BOOKS:
        for p in sorted((RUST_HTML / book).glob("print.html*")):
            yield "rust-books", p, html_text(read_maybe_gz(p))
    for p in sorted((RUST_HTML / "src").rglob("*.rs.html*")):
        yield "rust-code", p, rust_source(read_maybe_gz(p))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="target/demo/corpus")
    args = ap.parse_args()
    missing = [str(p) for p in (PY_DOCS, PY_CODE, RUST_HTML / "book") if not p.exists()]
    if missing:
        sys.exit(f"missing {', '.join(missing)}: apt-get install python3.11-doc rust-doc libpython3.11-stdlib")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stats = {}
    with open(out / "docs.jsonl", "w") as f:
        for source, path, text in documents():
            if len(text.strip()) < 200:
                continue
            split = "valid" if hashlib.sha1(str(path).encode()).digest()[0] < HOLD_OUT_BELOW else "train"
            f.write(json.dumps({"source": source, "path": str(path), "split": split, "text": text}) + "\n")
            s = stats.setdefault(source, {"docs": 0, "bytes": 0, "valid_docs": 0, "valid_bytes": 0})
            n = len(text.encode())
            s["docs"] += 1
            s["bytes"] += n
            if split == "valid":
                s["valid_docs"] += 1
                s["valid_bytes"] += n
    (out / "sources.json").write_text(json.dumps(stats, indent=2) + "\n")
    for k, s in stats.items():
        print(f"{k:12} {s['docs']:5} docs {s['bytes'] / 1e6:7.2f} MB (validation: {s['valid_docs']} docs, "
              f"{s['valid_bytes'] / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
