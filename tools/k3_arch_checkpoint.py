#!/usr/bin/env python3
"""A Kimi-K3-architecture checkpoint at the release's real dimensions, with few layers and experts, in the real
Hugging Face layout: the one model that Deltafin (`deltafin convert`) and llama.cpp (`convert_hf_to_gguf.py`)
both read, for the side-by-side of BENCHMARKS section 13.

    python3 tools/k3_arch_checkpoint.py --out /work/bench/k3-arch4-hf            # 4 layers: KDA KDA KDA MLA

The geometry is `deltafin synth --preset kimi-k3 --layers 4 --experts 64 --spine real` (k3-real4): hidden 7168,
96 KDA heads x 128, NoPE MLA (q_lora 1536, kv_lora 512, 96 heads, nope/rope/v 128/64/128), every layer MoE (no
dense first layer), latent 3584, moe_intermediate 3072, 64 MXFP4 experts, top-16, 2 shared experts, vocabulary
163,840 (a tiny BPE tokenizer: the benchmarks feed token ids). About 14 GB, written tensor by tensor in row
blocks (the embedding and head alone are 2.35 GB each in BF16), so memory stays near one block.

Weights are random (seeded per tensor name, as in make_fixtures.py), with the same scales as the fixtures: a
matrix ~ N(0, 1/fan_in) in BF16, norms ~ 1, MXFP4 experts with random nibbles and per-group exponents.
Needs numpy only (and make_fixtures.py beside it for the config, tokenizer and number formats).
"""

import argparse
import json
import math
import struct
import sys
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402

SPEC = dict(
    hidden=7168, layers=4, kda_layers=[1, 2, 3], full_attn_layers=[4],
    kda_heads=96, kda_head_dim=128, mla_heads=96, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128,
    latent=3584, moe_inter=3072, inter=33792, experts=64, top_k=16, attn_res_block=12,
    gate_lower_bound=-5.0, routed_scaling_factor=1.0, n_ranks=500, max_pos=1048576,
    shard_layout="release", seed=41,
)
VOCAB = 163840
ROW_BLOCK_BYTES = 64 << 20  # rows generated and written per step


class Lazy:
    """One tensor to be generated while it is written: dtype, shape and a function of (row0, rows) that returns
    those rows as the bytes the file stores."""

    def __init__(self, dtype, shape, rows_fn):
        self.dtype, self.shape, self.rows_fn = dtype, tuple(shape), rows_fn

    @property
    def nbytes(self):
        return mf.DTYPE_SIZE[self.dtype] * math.prod(self.shape)


def rng_for(seed, name, block):
    return np.random.default_rng([seed, zlib.crc32(name.encode()), block])


def bf16_bytes(a):
    """f32 -> bf16 bytes, round to nearest even, in 32-bit arithmetic (the 64-bit path of make_fixtures would
    need 8 bytes per value)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype("<u2").tobytes()


def matrix(seed, name, rows, cols, gain=1.0):
    std = gain / math.sqrt(cols)

    def gen(r0, n):
        g = rng_for(seed, name, r0)
        return bf16_bytes(g.standard_normal(size=(n, cols), dtype=np.float32) * np.float32(std))

    return Lazy("BF16", (rows, cols), gen)


def vector(seed, name, shape, fn, dtype="BF16"):
    def gen(r0, n):
        a = np.asarray(fn(rng_for(seed, name, 0)), dtype=np.float32).reshape(shape)[r0:r0 + n]
        return bf16_bytes(a) if dtype == "BF16" else a.astype("<f4").tobytes()

    return Lazy(dtype, shape, gen)


def norm(seed, name, n, dtype="BF16"):
    return vector(seed, name, (n,), lambda g: 1.0 + 0.1 * g.normal(size=n), dtype)


def mxfp4(seed, name, rows, cols):
    """The packed nibbles and the scales of one expert matrix, from one draw (make_fixtures.mxfp4_random)."""
    cache = {}

    def draw():
        if "v" not in cache:
            cache["v"] = mf.mxfp4_random(rng_for(seed, name, 0), rows, cols)
        return cache["v"]

    def packed(r0, n):
        return draw()[0][r0:r0 + n].tobytes()

    def scales(r0, n):
        out = draw()[1][r0:r0 + n].tobytes()
        if r0 + n >= rows:
            cache.clear()  # the scales are written after the packed values (release order): done with both
        return out

    return Lazy("U8", (rows, cols // 2), packed), Lazy("U8", (rows, cols // mf.MXFP4_GROUP), scales)


def layer_tensors(s, i):
    seed, H, E = s["seed"], s["hidden"], s["experts"]
    heads, D = s["kda_heads"], s["kda_head_dim"]
    P = heads * D
    LAT, I = s["latent"], s["moe_inter"]
    nh, nope, rope, vd = s["mla_heads"], s["nope"], s["rope"], s["v"]
    t = {}
    p = f"language_model.model.layers.{i}."
    for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
        t[p + n + ".weight"] = norm(seed, p + n, H)
    t[p + "self_attention_res_proj.weight"] = matrix(seed, p + "self_attention_res_proj", 1, H, gain=1.5)
    t[p + "mlp_res_proj.weight"] = matrix(seed, p + "mlp_res_proj", 1, H, gain=1.5)
    a = p + "self_attn."
    if (i + 1) in s["kda_layers"]:
        for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
            t[a + n + ".weight"] = matrix(seed, a + n, P, H)
        for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
            t[a + n + ".weight"] = vector(seed, a + n, (P, 1, mf.SHORT_CONV),
                                         lambda g: 0.5 * g.normal(size=P * mf.SHORT_CONV), "F32")
        t[a + "f_a_proj.weight"] = matrix(seed, a + "f_a_proj", D, H)
        t[a + "f_b_proj.weight"] = matrix(seed, a + "f_b_proj", P, D)
        t[a + "b_proj.weight"] = matrix(seed, a + "b_proj", heads, H)
        t[a + "o_norm.weight"] = norm(seed, a + "o_norm", D, "F32")
        t[a + "o_proj.weight"] = matrix(seed, a + "o_proj", H, P)
        t[a + "dt_bias"] = vector(seed, a + "dt_bias", (P,), lambda g: 0.1 * g.normal(size=P), "F32")

        def a_log(g):
            v = np.zeros(D, dtype=np.float32)
            v[:heads] = np.log(g.uniform(1.0, 16.0, size=heads))
            return v

        t[a + "A_log"] = vector(seed, a + "A_log", (D,), a_log, "F32")
    else:
        t[a + "q_a_proj.weight"] = matrix(seed, a + "q_a_proj", s["q_lora"], H)
        t[a + "q_a_layernorm.weight"] = norm(seed, a + "q_a_layernorm", s["q_lora"])
        t[a + "q_b_proj.weight"] = matrix(seed, a + "q_b_proj", nh * (nope + rope), s["q_lora"])
        t[a + "kv_a_proj_with_mqa.weight"] = matrix(seed, a + "kv_a_proj_with_mqa", s["kv_lora"] + rope, H)
        t[a + "kv_a_layernorm.weight"] = norm(seed, a + "kv_a_layernorm", s["kv_lora"])
        t[a + "kv_b_proj.weight"] = matrix(seed, a + "kv_b_proj", nh * (nope + vd), s["kv_lora"])
        t[a + "g_proj.weight"] = matrix(seed, a + "g_proj", nh * vd, H)
        t[a + "o_proj.weight"] = matrix(seed, a + "o_proj", H, nh * vd)
    m = p + "block_sparse_moe."
    t[m + "gate.weight"] = matrix(seed, m + "gate", E, H, gain=1.5)
    t[m + "gate.e_score_correction_bias"] = vector(seed, m + "bias", (E,), lambda g: 0.05 * g.normal(size=E), "F32")
    t[m + "routed_expert_down_proj.weight"] = matrix(seed, m + "routed_expert_down_proj", LAT, H)
    t[m + "routed_expert_norm.weight"] = norm(seed, m + "routed_expert_norm", LAT)
    t[m + "routed_expert_up_proj.weight"] = matrix(seed, m + "routed_expert_up_proj", H, LAT)
    t[m + "shared_experts.gate_proj.weight"] = matrix(seed, m + "shared_experts.gate_proj", 2 * I, H)
    t[m + "shared_experts.up_proj.weight"] = matrix(seed, m + "shared_experts.up_proj", 2 * I, H)
    t[m + "shared_experts.down_proj.weight"] = matrix(seed, m + "shared_experts.down_proj", H, 2 * I)
    for e in range(E):
        for proj, rows, cols in (("w1", I, LAT), ("w2", LAT, I), ("w3", I, LAT)):
            n = f"{m}experts.{e}.{proj}."
            t[n + "weight_packed"], t[n + "weight_scale"] = mxfp4(seed, n, rows, cols)
    return t


def top_tensors(s, vocab):
    seed, H = s["seed"], s["hidden"]
    top = "language_model.model."
    # the embedding's rows are O(1) (make_fixtures draws N(0, 1)); the head's gain 3 as there
    return {
        top + "embed_tokens.weight": matrix(seed, "embed", vocab, H, gain=math.sqrt(H)),
        top + "norm.weight": norm(seed, top + "norm", H),
        top + "output_attn_res_norm.weight": norm(seed, top + "output_attn_res_norm", H),
        top + "output_attn_res_proj.weight": matrix(seed, top + "output_attn_res_proj", 1, H, gain=1.5),
        "language_model.lm_head.weight": matrix(seed, "lm_head", vocab, H, gain=3.0),
    }


def write_shard(path, tensors, progress):
    """safetensors in the release's data order (dtype size descending, then name), header in data order."""
    order = sorted(tensors, key=lambda n: (-mf.DTYPE_SIZE[tensors[n].dtype], n))
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for n in order:
        b = tensors[n].nbytes
        header[n] = {"dtype": tensors[n].dtype, "shape": list(tensors[n].shape), "data_offsets": [off, off + b]}
        off += b
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * ((8 - len(hjson) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for n in order:
            t = tensors[n]
            rows = t.shape[0]
            row_bytes = max(1, t.nbytes // rows)
            step = max(1, ROW_BLOCK_BYTES // row_bytes)
            written = 0
            for r0 in range(0, rows, step):
                b = t.rows_fn(r0, min(step, rows - r0))
                f.write(b)
                written += len(b)
            assert written == t.nbytes, (n, written, t.nbytes)
            progress(t.nbytes)
    return off


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=4, help="KDA:MLA 3:1 (every fourth layer MLA), as in K3")
    ap.add_argument("--experts", type=int, default=64)
    args = ap.parse_args()
    s = dict(SPEC, layers=args.layers, experts=args.experts, top_k=min(16, args.experts))
    s["kda_layers"] = [i for i in range(1, args.layers + 1) if i % 4 != 0]
    s["full_attn_layers"] = [i for i in range(1, args.layers + 1) if i % 4 == 0]
    hf = args.out
    hf.mkdir(parents=True, exist_ok=True)
    _, _, specials = mf.write_tokenizer(hf, s["n_ranks"], s["max_pos"], pieces=mf._pieces_plain)
    config = mf.make_config(s, VOCAB, specials)
    config["text_config"]["first_k_dense_replace"] = 0  # every layer MoE, as in `deltafin synth`
    (hf / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    groups = [layer_tensors(s, i) for i in range(s["layers"])] + [top_tensors(s, VOCAB)]
    total_bytes = sum(t.nbytes for g in groups for t in g.values())
    done, t0 = [0], time.time()

    def progress(b):
        done[0] += b
        el = time.time() - t0
        print(f"\r  {done[0] / 1e9:6.2f} / {total_bytes / 1e9:.2f} GB, {el:5.0f} s", end="", file=sys.stderr, flush=True)

    weight_map, total = {}, 0
    for k, g in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):06d}.safetensors"
        total += write_shard(hf / fname, g, progress)
        weight_map.update({n: fname for n in g})
    print(file=sys.stderr)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    print(f"{hf}: {len(weight_map)} tensors, {total} bytes of tensors; layers {s['layers']} "
          f"(KDA {s['kda_layers']}, MLA {s['full_attn_layers']}), {s['experts']} experts top-{s['top_k']}, "
          f"vocab {VOCAB}, {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
