#!/usr/bin/env python3
"""Export a trained demo checkpoint as a Kimi K3 Hugging Face checkpoint, then check the export.

    .venv-demo/bin/python tools/demo/export.py --ckpt RUN/compact --tokenizer target/demo/tokenizer \\
        --out target/demo/hf

--ckpt is a compact checkpoint folder (train.py --compact), a full checkpoint file (ckpt-SSSSSSS.pt) or a run folder
(its latest ckpt-*.pt). The output folder gets what fixtures/*/hf hold:
    config.json                        kimi_k3 wrapper, text_config (kimi_linear) + compressed-tensors MXFP4 section
    model-0000i-of-0000NN.safetensors  one decoder layer per shard, then one for the embeddings, head and final
                                       norms; bf16 matrices and norms, the release's f32 tensors in f32, routed
                                       experts MXFP4 (weight_packed / weight_scale), as k3_torch.save_hf writes them
    model.safetensors.index.json       weight_map and total_size
    tiktoken.model, tokenizer_config.json, generation_config.json   copied from --tokenizer

Then the export is loaded back with k3_torch.load_hf and run on a fixed text next to the in-memory model with its
routed experts put through the same MXFP4 round trip (so the difference is the bf16 rounding of the spine alone),
and next to the plain training weights (MXFP4 error included): the relative logit difference
max |a - b| / max |b|, the per-position argmax agreement and a greedy continuation from both.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import k3_torch as k3  # noqa: E402
from train import load_compact, projected_sizes, resolve_full, mb  # noqa: E402

TEXT = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


fn main() {
    let v: Vec<u32> = (1..=10).collect();
    println!("{:?}", v.iter().sum::<u32>());
}
'''
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "generation_config.json")


def log(msg: str) -> None:
    print(msg, flush=True)


def load_checkpoint(path: Path) -> tuple:
    """-> (model in float32 on CPU, description)."""
    if path.is_dir() and (path / "state.json").exists():
        cfg, sd, meta, _ = load_compact(path)
        what = f"compact checkpoint {path} (step {meta['state']['step']}, bf16 weights)"
    else:
        f = resolve_full(path)
        ck = torch.load(f, map_location="cpu", weights_only=False)
        cfg, sd = k3.K3Config.from_dict(ck["config"]), ck["model"]
        what = f"full checkpoint {f} (step {ck['state']['step']}, f32 weights)"
    model = k3.K3ForCausalLM(cfg)
    model.load_state_dict({n: t.float() for n, t in sd.items()}, strict=True)
    model.eval()
    model.set_kda_mode("chunk")
    return model, what


def shard_groups(names, n_layers: int) -> list:
    """One decoder layer per shard, then everything else (embeddings, head, final norms), as the fixtures do."""
    groups = [[] for _ in range(n_layers + 1)]
    for n in names:
        if n.startswith("language_model.model.layers."):
            groups[int(n.split(".")[3])].append(n)
        else:
            groups[n_layers].append(n)
    return [g for g in groups if g]


def export(model: k3.K3ForCausalLM, out: Path, tokenizer: Path) -> None:
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("model*.safetensors")) + [out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    # save_hf writes config.json and one shard; re-cut that shard per layer
    single = out / ".save_hf"
    shutil.rmtree(single, ignore_errors=True)
    k3.save_hf(model, single)
    tensors = {}
    for f in sorted(single.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    groups = shard_groups(sorted(tensors), model.cfg.num_hidden_layers)
    weight_map, total = {}, 0
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):06d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(out / fname), metadata={"format": "pt"})
        (out / fname).chmod(0o644)
        for n in names:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    shutil.copy(single / "config.json", out / "config.json")
    shutil.rmtree(single)

    for name in TOKENIZER_FILES:
        src = tokenizer / name
        if src.exists():
            shutil.copy(src, out / name)
        elif name == "generation_config.json":
            gen = {"max_length": model.cfg.raw.get("max_position_embeddings", 8192),
                   "eos_token_id": model.cfg.raw.get("eos_token_id")}
            (out / name).write_text(json.dumps(gen, indent=2) + "\n")
            log(f"note: {src} missing; wrote generation_config.json with eos_token_id {gen['eos_token_id']}")
        else:
            log(f"WARNING: {src} missing; the bundle has no {name}")

    experts = sum(t.numel() * t.element_size() for n, t in tensors.items() if ".experts." in n)
    files = sorted(p for p in out.iterdir() if p.is_file())
    bundle = sum(p.stat().st_size for p in files)
    shards = sum(p.stat().st_size for p in files if p.suffix == ".safetensors")
    log(f"wrote {out}: {len(groups)} shards, {len(tensors)} tensors")
    log(f"  tensors {mb(total)}: routed experts (MXFP4) {mb(experts)}, spine (bf16 / f32) {mb(total - experts)}")
    log(f"  shard files {mb(shards)}; tokenizer and configs {mb(bundle - shards)}; bundle {mb(bundle)}")
    log(f"  Deltafin store (int8 spine + MXFP4 experts), estimated: ~{mb(projected_sizes(model)['store'])}")


def text_ids(tokenizer: Path, cfg: k3.K3Config, text: str) -> tuple:
    """-> (ids [1, T] starting with [BOS], decode function or None)."""
    bos = cfg.raw.get("bos_token_id")
    path = tokenizer / "tiktoken.model"
    try:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        sys.path.insert(0, str(HERE.parent))
        from make_fixtures import K3_PAT

        ranks = load_tiktoken_bpe(str(path))
        enc = tiktoken.Encoding(name="deltafin-demo", pat_str=K3_PAT, mergeable_ranks=ranks, special_tokens={})
        ids = enc.encode(text)
        n_ranks = len(ranks)

        def decode(seq):
            return enc.decode([t for t in seq if t < n_ranks])

        log(f"text: {len(text)} characters -> {len(ids)} tokens with {path}")
    except Exception as e:  # no tokenizer (smoke tests): a fixed pseudo-random prompt
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, min(cfg.vocab_size, 7936), (64,), generator=g).tolist()
        decode = None
        log(f"text: no usable tokenizer at {path} ({type(e).__name__}); a fixed random prompt of 64 ids")
    if bos is not None:
        ids = [bos] + ids
    return torch.tensor([ids], dtype=torch.int64), decode


def with_mxfp4_experts(model: k3.K3ForCausalLM) -> k3.K3ForCausalLM:
    """A copy whose routed-expert weights went through MXFP4 quantise -> dequantise (what the export stores)."""
    q = k3.K3ForCausalLM(model.cfg)
    sd = {}
    for n, t in model.state_dict().items():
        if ".experts." in n and n.endswith(".weight"):
            t = k3.mxfp4_dequantize(*k3.mxfp4_quantize(t))
        sd[n] = t
    q.load_state_dict(sd, strict=True)
    q.eval()
    q.set_kda_mode("chunk")
    return q


@torch.no_grad()
def greedy(model, ids: torch.Tensor, n: int) -> list:
    seq = ids.clone()
    for _ in range(n):
        nxt = model(seq)[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        seq = torch.cat([seq, nxt], dim=1)
    return seq[0, ids.shape[1]:].tolist()


@torch.no_grad()
def check(model: k3.K3ForCausalLM, out: Path, tokenizer: Path, text: str, n_greedy: int) -> None:
    reloaded = k3.load_hf(out)
    reloaded.eval()
    reloaded.set_kda_mode("chunk")
    ref_q = with_mxfp4_experts(model)
    ids, decode = text_ids(tokenizer, model.cfg, text)
    a = reloaded(ids)[0]  # [T, V]
    b = ref_q(ids)[0]
    c = model(ids)[0]

    def cmp(label, x, y):
        rel = float((x - y).abs().max() / y.abs().max())
        agree = float((x.argmax(-1) == y.argmax(-1)).float().mean())
        log(f"  {label:<58s} rel {rel:.2e}  argmax agreement {agree * 100:.1f}% of {len(x)} positions")

    log("logits on the fixed text:")
    cmp("export (load_hf) vs training weights, experts MXFP4 round trip", a, b)
    cmp("export (load_hf) vs training weights as trained (f32 experts)", a, c)
    ga, gb = greedy(reloaded, ids, n_greedy), greedy(ref_q, ids, n_greedy)
    same = next((i for i, (x, y) in enumerate(zip(ga, gb)) if x != y), len(ga))
    log(f"greedy {n_greedy} tokens: export and training weights (MXFP4 experts) agree on the first {same}"
        + (" (identical)" if ga == gb else ""))
    if decode is not None:
        log(f"  export continues the text with: {decode(ga)!r}")
    else:
        log(f"  export: {ga}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="compact folder, full ckpt-*.pt, or a run folder")
    ap.add_argument("--tokenizer", default=str(HERE.parent.parent / "target/demo/tokenizer"),
                    help="folder with tiktoken.model, tokenizer_config.json, generation_config.json")
    ap.add_argument("--out", required=True, help="output folder (the Hugging Face checkpoint)")
    ap.add_argument("--text", default=TEXT, help="the fixed text of the logit check")
    ap.add_argument("--greedy", type=int, default=16, help="tokens of greedy continuation to compare")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, what = load_checkpoint(Path(args.ckpt))
    log(f"loaded {what}")
    export(model, Path(args.out), Path(args.tokenizer))
    check(model, Path(args.out), Path(args.tokenizer), args.text, args.greedy)


if __name__ == "__main__":
    main()
