#!/usr/bin/env python3
"""Train the demo model's byte-level BPE tokenizer on its corpus and tokenize the corpus with it.

    python3 tools/demo/tokenizer.py --corpus target/demo/corpus --out target/demo/tokenizer --ranks 7936

Writes, in Kimi K3's own formats (what Deltafin and mlx-lm read):
    tiktoken.model           `base64(bytes) rank` per line: 256 single bytes, then merges in training order
    tokenizer_config.json    K3's special tokens at K3's offsets from the first special id (K3: 163584 + offset):
                             [BOS] +0, [EOS] +1, <|end_of_msg|> +2, <|open|> +3, <|close|> +4, <|sep|> +5,
                             [start_header_id] +6, [end_header_id] +7, [EOT] +9, media +18..+21,
                             <osagent_mode> +65, [UNK] +254, [PAD] +255; the other slots are reserved tokens
    generation_config.json   eos_token_id = <|end_of_msg|>, as K3's
    train.bin, valid.bin     uint16 token ids: each document as [BOS] + its tokens, documents back to back
    stats.json               ranks, vocabulary, tokens per split and source, bytes per token

Merges are learned with the `tokenizers` package over K3's pre-tokenisation pieces; the corpus is then encoded with
the `tiktoken` package on the written rank file and K3's regex, the same algorithm Deltafin's tokenizer runs
(lowest-rank pair first), so the training data is tokenized exactly as the runtime will tokenize text.
"""

import argparse
import base64
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from make_fixtures import K3_PAT, write_tokenizer_configs  # noqa: E402  one copy of K3's regex and configs

SLOTS = 256  # K3: ids 163584..163839
NAMED = {
    0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
    6: "[start_header_id]", 7: "[end_header_id]", 9: "[EOT]",
    18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
    65: "<osagent_mode>", 254: "[UNK]", 255: "[PAD]",
}
NOT_SPECIAL = {"<|open|>", "<|close|>", "<|sep|>"}  # K3 marks the XTML delimiters special: false


def bytes_to_unicode():
    """The byte-level alphabet of GPT-2 / `tokenizers`' ByteLevel: every byte as one printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def docs(corpus: Path, split=None):
    with open(corpus / "docs.jsonl") as f:
        for line in f:
            d = json.loads(line)
            if split is None or d["split"] == split:
                yield d


def train_ranks(corpus: Path, n_ranks: int):
    import regex
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    pat = regex.compile(K3_PAT, flags=regex.V1)
    counts = Counter()
    for d in docs(corpus, "train"):
        counts.update(pat.findall(d["text"]))
    print(f"{len(counts)} distinct pieces, {sum(counts.values())} in all", flush=True)
    tok = Tokenizer(models.BPE())
    # The pieces are K3's already: only the byte-to-character mapping is left to do.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=n_ranks, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=[],
    )

    # Each distinct piece once per occurrence would be 10^7 strings; a piece repeated c times in one string is
    # not the same (merges across copies), so feed pieces with their counts through the iterator in batches.
    def pieces():
        for p, c in counts.items():
            for _ in range(c):
                yield p

    tok.train_from_iterator(pieces(), trainer=trainer, length=sum(counts.values()))
    char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    vocab = tok.get_vocab()
    ranks = {}
    for s, i in sorted(vocab.items(), key=lambda kv: kv[1]):
        ranks[bytes(char_to_byte[ch] for ch in s)] = i
    assert sorted(ranks.values()) == list(range(len(ranks))), "ranks must be 0..n-1"
    assert all(bytes([b]) in ranks for b in range(256)), "every byte must have a rank"
    return ranks


def write_tokenizer(out: Path, ranks, max_pos: int):
    n = len(ranks)
    with open(out / "tiktoken.model", "w") as f:
        for tok, r in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(tok).decode()} {r}\n")
    specials = [dict(id=n + off, content=name, named=True, special=name not in NOT_SPECIAL)
                for off, name in sorted(NAMED.items())]
    write_tokenizer_configs(out, specials, max_pos)
    return n + SLOTS


def encoding(out: Path):
    """The tokenizer as tiktoken runs it (and as Deltafin does): K3's regex over the written rank file."""
    import tiktoken

    ranks = {}
    for line in (out / "tiktoken.model").read_text().splitlines():
        b64, r = line.split()
        ranks[base64.b64decode(b64)] = int(r)
    return tiktoken.Encoding("deltafin-demo", pat_str=K3_PAT, mergeable_ranks=ranks, special_tokens={})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="target/demo/corpus")
    ap.add_argument("--out", default="target/demo/tokenizer")
    ap.add_argument("--ranks", type=int, default=7936, help="BPE ranks (vocabulary = ranks + 256 special slots)")
    ap.add_argument("--max-pos", type=int, default=8192)
    args = ap.parse_args()
    corpus, out = Path(args.corpus), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ranks = train_ranks(corpus, args.ranks)
    vocab = write_tokenizer(out, ranks, args.max_pos)
    assert vocab <= 65536, "uint16 token files"
    enc = encoding(out)
    bos = len(ranks)
    stats = {"ranks": len(ranks), "vocab_size": vocab, "bos_token_id": bos, "splits": {}}
    for split in ("train", "valid"):
        ids, per_source = [], Counter()
        n_bytes = 0
        for d in docs(corpus, split):
            toks = enc.encode_ordinary(d["text"])
            ids.append(bos)
            ids.extend(toks)
            per_source[d["source"]] += len(toks) + 1
            n_bytes += len(d["text"].encode())
        arr = np.asarray(ids, dtype=np.uint16)
        arr.tofile(out / f"{split}.bin")
        stats["splits"][split] = {"tokens": len(arr), "bytes": n_bytes, "bytes_per_token": n_bytes / max(1, len(arr)),
                                  "per_source": dict(per_source)}
        print(f"{split}: {len(arr)} tokens, {n_bytes / max(1, len(arr)):.2f} bytes per token", flush=True)
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")


if __name__ == "__main__":
    main()
